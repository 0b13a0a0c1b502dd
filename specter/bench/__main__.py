"""Entry point of `python -m specter.bench`, as the `specter-bench` console script runs it (`specter.entry`)."""

from specter.entry import bench

bench()
