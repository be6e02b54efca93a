"""A federation in one process: FML on six clients of two architectures, against training alone."""

from coordinator.config import load_config
from coordinator.simulator import simulate

settings = {"algorithm": "fml", "models": ["mlr", "mlp"], "clients": 6, "rounds": 3}
settings |= {"data.dataset": "digits", "baselines": ["local"], "out": "runs/first"}
results = simulate(load_config(flags=settings))  # writes results.json and report.html to out

print(f"outcome: {results.summary.outcome}")  # complete: every round got its quorum
for c in results.clients:  # each client's accuracy on its own test split
    print(f"{c.id} {c.arch}: personalized {c.personal_acc:.1%}, alone {c.local_acc:.1%}")
