"""Every selected worker at once: the fan-out. The `Fleet` (interface.py: its operations, and the records
they answer with) is the one road from `job/`, `sync/` and the commands to the workers; threads.py is its
direct implementation (a thread of this machine per worker), relays.py its relayed one
(relays inside the slice, `tpurun.worker.relay` on the workers); bundle.py installs tpurun's programs on a
worker and gives the argv that runs one; targets.py resolves the workers a command acts on and builds the
fleet that reaches them. Each worker's own connection is `tpurun.transport`'s."""
