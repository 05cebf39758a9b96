"""`servelab bench --workers N [--ray-address ADDR]`: one schedule, many client workers.

``driver.WorkerPool`` plans nothing itself: the benchmark's plan is dealt to workers
(``partition``), which run it with the ordinary ``bench.runner.Runner`` (``worker``) as
local processes (``local``) or Ray actors (``ray_workers``), start together on a clock
measured against the driver's (``clock``), and stream their records back. Ray is
imported only by ``ray_workers``. See docs/design/distributed-bench.md.
"""
