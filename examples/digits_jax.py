"""Train a small MLP on scikit-learn's bundled digits data set with JAX, data-parallel, one process per host.

    tpurun train digits_jax.py --tpu my-tpu                      # every host of a TPU VM, pod slice or multislice
    tpurun train digits_jax.py --tpu my-tpu --runtime cpu --cores 1   # on workers without a TPU (CPU devices)

The script is what a JAX user writes for a pod: `jax.distributed.initialize()` with no arguments, one mesh
over every device of every process, and a `jax.lax.pmean` that averages the gradients across all of them.
On a TPU VM jax finds its slice (and the other slices of a multislice TPU) from the VM itself; where there
is no TPU, tpurun gives the coordinator, the process count and the process id (docs/train.md). Started
by hand without tpurun it trains alone. The data set ships with scikit-learn (no download).

Before training, every process prints an all-reduce check: the sum, over every device of every process,
of its process index + 1. A process that is not joined to the others sees only its own share.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


def join() -> None:
    try:
        jax.distributed.initialize()
    except ValueError:
        pass  # nothing to join: started by hand on one machine


def init_params(sizes: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)  # the same weights on every process
    return [
        (rng.normal(0, np.sqrt(2 / m), (m, n)).astype(np.float32), np.zeros(n, np.float32))
        for m, n in zip(sizes[:-1], sizes[1:], strict=True)
    ]


def forward(params, x):
    for w, b in params[:-1]:
        x = jax.nn.relu(x @ w + b)
    w, b = params[-1]
    return x @ w + b


def loss_fn(params, x, y):
    logits = forward(params, x)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--per-device-batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()

    join()
    me, procs = jax.process_index(), jax.process_count()
    local = jax.local_device_count()
    tag = f"[process {me}/{procs}]"
    mesh = Mesh(np.array(jax.devices()), ("data",))
    sharded, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())

    def global_array(local_data, sharding):
        return jax.make_array_from_process_local_data(sharding, local_data)

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=P("data"), out_specs=P())
    def total(v):
        return jax.lax.psum(jnp.sum(v), "data")

    check = total(global_array(np.full((local,), me + 1.0, np.float32), sharded))
    expected = local * procs * (procs + 1) / 2  # every process has as many devices as this one
    print(f"{tag} all-reduce check: {float(check.addressable_data(0)):.1f} (expected {expected:.1f})", flush=True)

    @jax.jit
    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P()))
    def step(params, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        grads = jax.lax.pmean(grads, "data")  # the gradient of the global batch, on every device
        params = jax.tree.map(lambda p, g: p - args.lr * g, params, grads)
        return params, jax.lax.pmean(loss, "data")

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    x_mine, y_mine = x_train[me::procs], y_train[me::procs]  # this process's shard
    batch = args.per_device_batch * local  # this process's part of each global batch
    params = jax.tree.map(lambda a: global_array(a, replicated), init_params([64, 128, 10]))
    print(f"{tag} {local} device(s) of {jax.device_count()}, {len(x_mine)} training samples", flush=True)

    rng = np.random.default_rng(me)
    start = time.time()
    for i in range(1, args.steps + 1):
        idx = rng.choice(len(x_mine), batch, replace=False)
        params, loss = step(params, global_array(x_mine[idx], sharded), global_array(y_mine[idx], sharded))
        if i % 100 == 0 or i == args.steps:
            host = [(np.asarray(w.addressable_data(0)), np.asarray(b.addressable_data(0))) for w, b in params]
            acc = float(np.mean(np.argmax(np.asarray(forward(host, x_test)), 1) == y_test))
            print(f"{tag} step {i} loss {float(loss.addressable_data(0)):.4f} test accuracy {acc:.3f}", flush=True)
    if me == 0:
        print(f"trained {args.steps} steps on {procs} process(es) in {time.time() - start:.1f} s", flush=True)
        print(f"final test accuracy: {acc:.3f}", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
