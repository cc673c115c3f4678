"""Ships the top-level `schemas/` inside the wheel as `pipeline/schemas/` (the project keeps the
schemas at the top level; an installed package must carry them). Everything else is pyproject.toml."""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithSchemas(build_py):
    def run(self):
        super().run()
        target = Path(self.build_lib) / "pipeline" / "schemas"
        target.mkdir(parents=True, exist_ok=True)
        for schema in sorted(Path(__file__).parent.joinpath("schemas").glob("*.schema.json")):
            shutil.copyfile(schema, target / schema.name)


setup(cmdclass={"build_py": BuildPyWithSchemas})
