"""Writes this folder with the code it runs under (it was run at commit 2869461, before the
guard became a wrapper and base.py was split): per algorithm, the state after one round
(`NAME.state`), and what the next round, the finalize and the deployed model were from there
(`NAME.expected`). test_state_compat.py loads them with today's code.

    cd <a checkout of that commit> && python tests/edge_sdk/data/states-2869461/make.py OUT
"""

import sys
from pathlib import Path

sys.path[:0] = [".", "tests/edge_sdk"]  # the checkout's packages, and its test helpers

import torch  # noqa: E402
from test_persistence import _algorithm, _models, _weights  # noqa: E402

from edge_sdk.state import save_state  # noqa: E402

ALGORITHMS = ["local", "fedavg", "fedprox", "fedavg_ft", "fml", "pfml", "persfl", "fedme"]
DETAILS = ("deployed", "deployed_arch", "samples_processed")

if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name in ALGORITHMS:
        torch.manual_seed(0)
        algo = _algorithm(name, seed=0)
        algo.fit(1, 2, _models(name, 1))
        save_state(out / f"{name}.state", algo.state_dict())
        best = algo.guard.best  # (that commit's name for the guard: today's algo.deployment.guard)
        kept = {} if best is None else {"label": best.label, "hits": best.hits, "loss": best.loss}
        nxt = algo.fit(2, 2, _models(name, 2))
        fin = algo.finalize(2, 2, _models(name, 2))
        _, model = algo.personalized_model()
        expected = {
            "round2": _weights(nxt),
            "deployed": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "details": {k: v for k, v in fin.details.items() if k in DETAILS},
            "guard_best": kept,  # what the guard kept after the first round
        }
        save_state(out / f"{name}.expected", expected)
