"""What runs a plan: the pool, streams, the RAM budget, the spill file, and the dispatcher."""
