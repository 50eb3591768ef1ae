"""How a driver on the host joins the embedded default: its record says where it listens
and in which authentication mode (Ray 2.60 turns token authentication on for a new local
instance, but not for a driver given an explicit address)."""

from __future__ import annotations

import os
import sys

import pytest

from rbln_ray.serve import local_ray


@pytest.fixture
def clean_env(tmp_path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("RBLN_RAY_CACHE", str(tmp_path))
    for name in (local_ray.AUTH_MODE_ENV, local_ray.AUTH_TOKEN_PATH_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(local_ray.SINGLE_HOST_ENV, "0")
    monkeypatch.delitem(sys.modules, "ray", raising=False)  # as in a fresh process
    return monkeypatch


def test_a_joining_driver_takes_the_embedded_default_s_token_mode(clean_env) -> None:
    clean_env.setenv(local_ray.AUTH_MODE_ENV, "token")  # what ray.init left in `serve`
    clean_env.setenv(local_ray.AUTH_TOKEN_PATH_ENV, "/secrets/ray-token")
    clean_env.setenv("RAY_AUTH_TOKEN", "s3cret-token-value")
    local_ray.record_embedded("127.0.0.1:6379")
    clean_env.delenv(local_ray.AUTH_MODE_ENV)
    clean_env.delenv(local_ray.AUTH_TOKEN_PATH_ENV)

    assert local_ray.embedded_address() == "127.0.0.1:6379"
    local_ray.prepare_to_join("127.0.0.1:6379")
    assert os.environ[local_ray.AUTH_MODE_ENV] == "token"
    assert os.environ[local_ray.AUTH_TOKEN_PATH_ENV] == "/secrets/ray-token"
    assert "s3cret" not in local_ray.embedded_record_path().read_text()  # the path only


def test_an_explicit_mode_and_other_instances_are_left_alone(clean_env) -> None:
    clean_env.setenv(local_ray.AUTH_MODE_ENV, "token")
    local_ray.record_embedded("127.0.0.1:6379")
    clean_env.setenv(local_ray.AUTH_MODE_ENV, "disabled")  # the user's choice wins
    local_ray.prepare_to_join("127.0.0.1:6379")
    assert os.environ[local_ray.AUTH_MODE_ENV] == "disabled"

    clean_env.delenv(local_ray.AUTH_MODE_ENV)
    local_ray.prepare_to_join("127.0.0.1:7000")  # not the recorded instance
    assert local_ray.AUTH_MODE_ENV not in os.environ


def test_a_stopped_embedded_default_is_not_joined(clean_env) -> None:
    local_ray.record_embedded("127.0.0.1:6379")
    path = local_ray.embedded_record_path()
    path.write_text(path.read_text().replace(str(os.getpid()), "999999999"))
    assert local_ray.embedded_address() is None
