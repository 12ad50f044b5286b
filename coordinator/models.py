"""MODEL arguments: a local folder, or `demo` (a small generated model, made on first use)."""

from pathlib import Path

from spill import config
from spill.errors import SpillError

DEMO = dict(family="llama", size="small", seed=0, dtype="bfloat16")


def resolve(model: str) -> Path:
    if model == "demo":
        folder = config.home() / "models" / "demo"
        if not (folder / "config.json").exists():
            from spill.factory import make_model
            make_model(folder, **DEMO)
        return folder
    folder = Path(model).expanduser()
    if folder.is_dir():
        return folder.resolve()
    raise SpillError(f"model {model!r}: expected a local model folder or 'demo', found no such folder; "
                     "check the path (Hugging Face ids are not supported yet)")
