"""What computing the MPNN's edge network once per forward saves, against PyG's NNConv recomputing it per step:

    python -m mtl.tools.qm9_edge_network [--graph complete|bonds] [--batch-size 120] [--molecules 1200]
                                         [--repeats 10] [--device cpu|cuda] [--cache-dir DIR] [--json out.json]

Both models (``mtl.models.backbones.mpnn.MPNN`` with ``reuse_edge_network`` True and False) hold the same parameters and
run a training step (forward, a sum of the features as the loss, backward) on the same batches of real QM9
molecules (qm9pack's first ``--molecules``, built by ``mtl.data.qm9``; on the papers' complete graph by default).
The two are timed alternately, batch by batch, so that the machine's load affects both alike; the figure is the
ratio of their median step times (PyG's / ours: above 1 means ours is faster), with the first pass untimed.
On CUDA the clock waits for the device before reading the time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from mtl.data import qm9
from mtl.errors import MTLError
from mtl.models.backbones.mpnn import MPNN


def step_time(model, batch, device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    model.zero_grad(set_to_none=True)
    model(batch).sum().backward()
    sync()
    return time.perf_counter() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graph", choices=("complete", "bonds"), default="complete")
    p.add_argument("--batch-size", type=int, default=120)
    p.add_argument("--molecules", type=int, default=1200)
    p.add_argument("--repeats", type=int, default=10, help="timed passes over the batches")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--cache-dir", default=None, help="where the processed QM9 graphs are cached")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    a = p.parse_args(argv)
    if a.batch_size < 1 or a.molecules < a.batch_size or a.repeats < 1:
        p.error("need --batch-size >= 1, --molecules >= --batch-size and --repeats >= 1")

    from torch_geometric.loader import DataLoader

    device = torch.device(a.device)
    try:
        graphs = qm9.load_qm9pack(a.cache_dir, limit=a.molecules, log=lambda m: print(m, file=sys.stderr))
    except MTLError as e:
        print(e.message, file=sys.stderr)
        return e.exit_code
    transform = qm9.CompleteGraph() if a.graph == "complete" else None
    data = [transform(g) if transform else g for g in (graphs[i] for i in range(len(graphs)))]
    edge_features = data[0].edge_attr.shape[1]
    batches = [b.to(device) for b in DataLoader(data, batch_size=a.batch_size, drop_last=True)]

    torch.manual_seed(0)
    ours = MPNN(edge_features=edge_features).to(device)
    pyg = MPNN(edge_features=edge_features, reuse_edge_network=False).to(device)
    pyg.load_state_dict(ours.state_dict())
    times = {"ours": [], "pyg": []}
    for rep in range(a.repeats + 1):
        for batch in batches:
            for name, model in (("ours", ours), ("pyg", pyg)) if rep % 2 else (("pyg", pyg), ("ours", ours)):
                t = step_time(model, batch, device)
                if rep:
                    times[name].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    edges = sum(int(b.edge_index.shape[1]) for b in batches) / len(batches)
    result = {"graph": a.graph, "device": str(device), "batch_size": a.batch_size, "batches": len(batches),
              "repeats": a.repeats, "edges_per_batch": edges, "median_step_s_ours": med["ours"],
              "median_step_s_pyg": med["pyg"], "ratio_pyg_over_ours": med["pyg"] / med["ours"]}
    print(f"{a.graph} graph, {device}, batch {a.batch_size} ({edges:.0f} edges), {len(batches)} batches x "
          f"{a.repeats}: median training step {med['ours'] * 1e3:.2f} ms (edge network once) vs "
          f"{med['pyg'] * 1e3:.2f} ms (PyG NNConv, per step): {result['ratio_pyg_over_ours']:.2f}x")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
