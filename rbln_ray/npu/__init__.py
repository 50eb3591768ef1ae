"""What an RBLN NPU is, independent of whether one is present: the kinds (ATOM, REBEL) with
their DRAM budgets (:mod:`kinds`) and the roofline cost model of a device call
(:mod:`cost_model`), shared by the emulator, the compile settings and the planner."""
