"""What a plan costs: topology, cost models, task graph and event simulation (the simulator
issue builds it). Imports ``strategies`` only, never ``soapsearch``."""

__all__: list[str] = []
