"""The planner: the best mesh and strategies for a model, a sequence length and a cluster.

    from jaxring.planner import Cluster, Workload, search
    result = search(Workload.of("gpt", "7b", seq_len=131072, global_batch_tokens=4 * 2**20),
                    Cluster.of("h200", devices=64))
    print(result.table(top=10)); print(result.rejections())
    result.best.candidate.train_flags()          # ["--sp", "8", "--tp", "8", "--attention", ...]

`python -m jaxring.planner --help` is the command line. The cost model (bytes per mesh axis, memory per
device, step time) is `jaxring/planner/cost_model.py`; its byte terms equal the compiled train step's
(`jaxring.analysis.axis_traffic.axis_traffic`), tests/unit/planner/test_planner.py checks them and the memory predictions.
"""

from jaxring.planner.cluster import DEVICES, Cluster
from jaxring.planner.search import NoPlanError, Result, evaluate, search
from jaxring.planner.space import Candidate, Workload

__all__ = ["DEVICES", "Candidate", "Cluster", "NoPlanError", "Result", "Workload", "evaluate", "search"]
