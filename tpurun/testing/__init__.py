"""Test and benchmark tooling shipped with tpurun (the latency proxy); not used by tpurun itself."""
