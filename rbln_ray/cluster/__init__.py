"""Running rbln-ray clusters with ``ray up`` on hosts that other Ray clusters may share.

* :mod:`rbln_ray.cluster.node_stop`: stop one Ray node of one cluster on this host (what
  ``ray stop`` does, minus every other Ray process on the host).
* :mod:`rbln_ray.cluster.provider`: Ray's on-prem ``local`` node provider with an SSH port and
  that scoped stop in place of the ``ray stop`` Ray's launcher hard-codes.
"""
