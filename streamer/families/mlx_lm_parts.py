"""mlx-lm's model code without its package's `__init__`, which imports `mlx_lm.utils` and with it transformers and
huggingface_hub (about 1.4 s a process start on 2 cores); a streamer never tokenizes.

    without_init()       `mlx_lm` stands in sys.modules; its `__init__` runs at the first use of a name of its own
    get_classes(config)  mlx_lm.utils._get_classes, compiled from that file's own source with the tables it reads
    infer_quant_config   mlx_lm.utils.infer_quant_config, the same way
"""

import ast
import importlib
import importlib.util
import os
import sys
from functools import cache
from pathlib import Path

# what is taken from mlx_lm/utils.py: the functions and the tables _get_classes reads
_TAKEN = ("MODEL_REMAPPING", "MODEL_ARCHITECTURE_REMAPPING", "_get_classes", "infer_quant_config")


def without_init() -> None:
    """Let `import mlx_lm.models.llama` (and cache, sample_utils) skip the package's `__init__` in this process,
    unless mlx_lm is imported already; `mlx_lm.load` and its other names still run it, on first use. For an actor's
    own process only: there `from mlx_lm import generate` would give the module of that name, not the function."""
    if "mlx_lm" in sys.modules:
        return
    spec = importlib.util.find_spec("mlx_lm")
    package = importlib.util.module_from_spec(spec)

    def init(name: str):
        del package.__getattr__
        spec.loader.exec_module(package)
        return getattr(package, name)

    package.__getattr__ = init
    os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"   # as its __init__ sets it, for a later mlx_lm.utils
    sys.modules["mlx_lm"] = package


def _named(node) -> str | None:
    if isinstance(node, ast.FunctionDef):
        return node.name
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    return None


@cache
def _utils() -> dict:
    """The names of _TAKEN, from mlx_lm.utils itself once imported, else compiled from its source."""
    if "mlx_lm.utils" not in sys.modules:
        import mlx.core as mx
        import mlx.nn as nn
        path = Path(importlib.util.find_spec("mlx_lm").submodule_search_locations[0]) / "utils.py"
        nodes = [node for node in ast.parse(path.read_text(), str(path)).body if _named(node) in _TAKEN]
        scope = {"importlib": importlib, "mx": mx, "nn": nn, "__name__": "mlx_lm.utils"}
        try:
            exec(compile(ast.Module(nodes, []), str(path), "exec"), scope)
        except NameError:   # mlx-lm's code reads another name now: import the module after all
            pass
        if all(name in scope for name in _TAKEN):
            return {name: scope[name] for name in _TAKEN}
    utils = importlib.import_module("mlx_lm.utils")
    return {name: getattr(utils, name) for name in _TAKEN}


def get_classes(config: dict):
    """(Model, ModelArgs) of the config's model_type, as mlx-lm's loader picks them."""
    return _utils()["_get_classes"](config)


def infer_quant_config(path: str, module, weights: dict) -> dict:
    """The group_size, bits and mode a saved weight was packed with, as mlx-lm's loader recovers them."""
    return _utils()["infer_quant_config"](path, module, weights)
