"""Multi-raylet clusters on this machine: ``ray up`` over loopback hosts and
``scripts/cluster_up.py``."""

# What `ray start` reports when its node's raylet did not come up. On 2 busy cores a starting
# raylet can abort before its dashboard agent, still importing, has written the port files the
# raylet waits for (Ray 2.60's NodeManager::WaitForDashboardAgentPorts gives it a fixed few
# seconds, not configurable, even for ports given on the command line); `ray start`'s own
# 30 s wait (ray/_private/node.py) then fails with this.
# The tests bring such a cluster up again on exactly this failure, at most three more times;
# any other failure fails them.
RAYLET_START_TIMEOUT = "The current node timed out during startup"
START_ATTEMPTS = 4
