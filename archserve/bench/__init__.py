"""`archserve bench`: offline throughput, serving latency, roofline, peer comparison, plots."""
