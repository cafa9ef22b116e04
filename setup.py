"""Package layout (the rest of the metadata is in pyproject.toml).

The example configs of the repository's `examples/` directory ship inside the wheel as the
data package `recursa.examples` (one sub-package per sub-directory, e.g.
`recursa.examples.rsipo_ablations`), so an installed recursa copies them out with
`recursa examples DIR`; an editable install maps the same package onto `examples/`.
"""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
EXAMPLE_DIRS = sorted(p.relative_to(HERE / "examples") for p in (HERE / "examples").rglob("*") if p.is_dir() and any(p.glob("*.toml")))

setup(
    packages=find_packages(include=["recursa", "recursa.*"])
    + ["recursa.examples"]
    + ["recursa.examples." + ".".join(d.parts) for d in EXAMPLE_DIRS],
    package_dir={"recursa.examples": "examples"},
    package_data={"recursa.examples": ["*.toml", "**/*.toml"]},
)
