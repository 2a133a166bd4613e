"""`tpurun sync`: the sender that builds the manifest and streams what changed to every worker's helper
(sender.py; the helper itself is tpurun/worker/sync_helper.py), and download; which files travel is
tpurun/ignore.py's."""
