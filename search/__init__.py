"""Strategy search: enumerate a space of distribution strategies, simulate it in batches, rank it.

from search import StrategySpace, evaluate
table = evaluate(StrategySpace(model="gpt2-xl", world_sizes=16, global_batch_sizes=(64, 256)))
print(table.top_k(5).format())
"""

from search.calibration import calibrate_configs
from search.evaluate import PRECISIONS, build_function, evaluate
from search.results import COLUMNS, STATUS_INVALID, STATUS_OK, STATUS_OOM, ResultTable
from search.single import (
    ConfigSummary,
    SingleResult,
    chrome_trace,
    coarse_chrome_trace,
    config_elasticities,
    make_config,
    simulate_config,
    summarize_config,
    write_chrome_trace,
)
from search.space import (
    RECOMPUTE,
    SCHEDULES,
    Config,
    StrategySpace,
    config_id,
    count_configs,
    enumerate_configs,
    factorisations,
)

__all__ = [
    "COLUMNS",
    "PRECISIONS",
    "RECOMPUTE",
    "SCHEDULES",
    "STATUS_INVALID",
    "STATUS_OK",
    "STATUS_OOM",
    "Config",
    "ConfigSummary",
    "ResultTable",
    "SingleResult",
    "StrategySpace",
    "build_function",
    "calibrate_configs",
    "chrome_trace",
    "coarse_chrome_trace",
    "config_elasticities",
    "config_id",
    "count_configs",
    "enumerate_configs",
    "evaluate",
    "factorisations",
    "make_config",
    "simulate_config",
    "summarize_config",
    "write_chrome_trace",
]
