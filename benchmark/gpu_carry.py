"""Pack what a GPU machine without a package index needs for the demo parts of
benchmark/gpu_suite.sh into the ignored folder .gpu/ of the working tree.

    python benchmark/gpu_carry.py            # here, once, with the demo and data installed

Writes .gpu/site/ (the pure-Python `gguf` package, the data files that sgl_jax.datasets
finds; ShareGPT only as --sharegpt-records held-out conversations), .gpu/meta/ (the demo
GGUF's converted metadata: the machine's transformers may predate the GGUF tokenizer
converter we call), .gpu/partNN (the demo GGUF in pieces that fit one call's transfer beside
the tree) and .gpu/on.sh. Each call on the machine carries `.gpu/site`, `.gpu/meta`,
`.gpu/on.sh` and one part it has not carried yet, and starts with `. .gpu/on.sh`: it keeps
the parts that came (in /tmp, which outlives a call while the machine stays warm), joins
them once all have come, and sets PYTHONPATH. Parts carried in calls that follow one another
at once arrive on the same machine; a machine given back in between starts bare.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import itertools
import json
import shutil
from pathlib import Path

from sgl_jax.datasets import HUMANEVAL, MT_BENCH, SHAREGPT, iter_sharegpt
from sgl_jax.demo import DEMO_GGUF, DEMO_PACKAGE, demo_model_path
from sgl_jax.models.gguf import GGUFCheckpoint

MAX_PART_BYTES = 32 << 20  # a tree of about 25 MiB and one part fit a call's 64 MiB
HELD_OUT_SHAREGPT = 12000  # bench_speculative's default --sharegpt-skip

ON_MACHINE = """\
# Sourced on the GPU machine at the start of each call (see benchmark/gpu_carry.py).
mkdir -p /tmp/sgl_jax_parts /tmp/sgl_jax_site
cp -r .gpu/site/. /tmp/sgl_jax_site/
for part in .gpu/part*; do [ -f "$part" ] && cp "$part" /tmp/sgl_jax_parts/; done
export PYTHONPATH=$PWD:/tmp/sgl_jax_site PYTHONUNBUFFERED=1
DEMO_GGUF=/tmp/sgl_jax_site/{package}/{gguf}
if [ ! -f "$DEMO_GGUF" ] && [ "$(ls /tmp/sgl_jax_parts | wc -l)" = {parts} ]; then
  cat /tmp/sgl_jax_parts/part* > "$DEMO_GGUF.tmp"
  if [ "$(md5sum < "$DEMO_GGUF.tmp" | cut -d' ' -f1)" = {md5} ]; then
    mv "$DEMO_GGUF.tmp" "$DEMO_GGUF"
  else
    echo "the joined demo GGUF is damaged" >&2
  fi
fi
if [ -f "$DEMO_GGUF" ]; then  # its converted metadata, where this machine's loader looks
  meta=$(python3 -c 'import sys, pathlib; from sgl_jax.models.gguf import metadata_dir
print(metadata_dir(pathlib.Path(sys.argv[1])))' "$DEMO_GGUF")
  mkdir -p "$meta" && cp -r .gpu/meta/. "$meta"/
else
  echo "the demo GGUF: $(ls /tmp/sgl_jax_parts | wc -l) of {parts} parts here" >&2
fi
"""


def copy_data_files(site: Path, sharegpt_records: int) -> None:
    """The data files at the paths sgl_jax.datasets looks under (package folder + path).
    ShareGPT (120 MB) only as `sharegpt_records` of its held-out conversations, those
    bench_speculative samples after its default skip: run it there with --sharegpt-skip 0."""
    for data in (MT_BENCH, HUMANEVAL, SHAREGPT):
        (site / data.package).mkdir(parents=True)
        (site / data.package / "__init__.py").write_text("")  # found, never imported
    for data in (MT_BENCH, HUMANEVAL):
        target = site / data.package / data.relative_path
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(data.path(), target)
    if sharegpt_records:
        held_out = itertools.islice(iter_sharegpt(), HELD_OUT_SHAREGPT,
                                    HELD_OUT_SHAREGPT + sharegpt_records)
        target = site / SHAREGPT.package / SHAREGPT.relative_path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(list(held_out)))


def split_file(path: Path, out: Path) -> int:
    """`path` in equal pieces of at most MAX_PART_BYTES, out/part00, part01, ...; returns
    their count."""
    data = path.read_bytes()
    count = -(-len(data) // MAX_PART_BYTES)
    size = -(-len(data) // count)
    for index in range(count):
        (out / f"part{index:02d}").write_bytes(data[index * size:(index + 1) * size])
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(".gpu"))
    parser.add_argument("--sharegpt-records", type=int, default=0,
                        help="held-out ShareGPT conversations to take (about 6 KB each)")
    args = parser.parse_args(argv)
    shutil.rmtree(args.out, ignore_errors=True)
    site = args.out / "site"
    gguf_package = Path(importlib.util.find_spec("gguf").origin).parent
    shutil.copytree(gguf_package, site / "gguf", ignore=shutil.ignore_patterns("__pycache__"))
    (site / DEMO_PACKAGE).mkdir(parents=True)
    (site / DEMO_PACKAGE / "__init__.py").write_text("")
    copy_data_files(site, args.sharegpt_records)
    gguf_file = demo_model_path()
    shutil.copytree(GGUFCheckpoint(gguf_file).model_dir, args.out / "meta",  # not its weights cache
                    ignore=shutil.ignore_patterns("dequantized.*"))
    parts = split_file(gguf_file, args.out)
    md5 = hashlib.md5(gguf_file.read_bytes()).hexdigest()
    (args.out / "on.sh").write_text(ON_MACHINE.format(
        package=DEMO_PACKAGE, gguf=DEMO_GGUF, parts=parts, md5=md5))
    sizes = {p.name: p.stat().st_size >> 20 for p in sorted(args.out.iterdir()) if p.is_file()}
    print(f"wrote {args.out}/: site and meta "
          f"({sum(f.stat().st_size for f in site.rglob('*') if f.is_file()) >> 20} MiB), "
          f"{parts} parts of the demo GGUF; MiB: {sizes}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
