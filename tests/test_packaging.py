"""What a wheel of pdserve carries: an install that is not editable (the container image, a wheel
from an index) builds the CPU kernels from their sources on first use, so every source must be
package data; without them the kernels are silently unavailable and torch runs everything."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

from pdserve.layers.kernels import native

ROOT = Path(__file__).resolve().parents[1]


def test_every_kernel_source_is_package_data():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["pdserve.layers.kernels"]
    sources = set(native._SOURCES) | set(native._COMPILED)
    assert sources <= {p.name for p in Path(native.__file__).parent.iterdir()}
    assert all(any(fnmatch.fnmatch(name, pattern) for pattern in patterns) for name in sources)
