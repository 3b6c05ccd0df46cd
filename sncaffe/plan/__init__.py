"""The memory planner: pure functions from a graph (plain data) to a plan (plain data); no thread, device or pool."""
