"""Write conf/model/<size>.yaml from ``cuboid.models.CONFIGS``, the one place model sizes are defined.

python scripts/model_configs.py          # (re)write the YAML files
python scripts/model_configs.py --check  # exit 1 if any file differs from the code (tests run this)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from omegaconf import OmegaConf

from cuboid.models import CONFIGS

CONF = Path(__file__).resolve().parents[1] / "conf" / "model"


def render(name: str) -> str:
    cfg = CONFIGS[name]
    header = (
        f"# Llama {name}: {cfg.num_params() / 1e6:.2f}M parameters. Generated from cuboid.models.CONFIGS[{name!r}] "
        "by scripts/model_configs.py: edit the code, then rerun it.\n"
    )
    return header + OmegaConf.to_yaml({"_target_": "cuboid.models.LlamaConfig", **dataclasses.asdict(cfg)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 on a difference")
    args = parser.parse_args()
    stale = [name for name in CONFIGS if not (CONF / f"{name}.yaml").is_file()
             or (CONF / f"{name}.yaml").read_text() != render(name)]  # fmt: skip
    extra = sorted(p.stem for p in CONF.glob("*.yaml") if p.stem not in CONFIGS)
    if args.check:
        if stale or extra:
            sys.exit(f"conf/model differs from cuboid.models.CONFIGS: stale {stale}, not in the code {extra}. "
                     "Run python scripts/model_configs.py.")  # fmt: skip
        return
    for name in stale:
        (CONF / f"{name}.yaml").write_text(render(name))
        print(f"wrote {CONF / name}.yaml")


if __name__ == "__main__":
    main()
