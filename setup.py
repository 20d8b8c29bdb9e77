"""Everything is in pyproject.toml but one file: the startup hook's ``.pth`` (see _lightning_ft_startup.py).

setuptools has no setting that puts a file at the top of site-packages; this build step does,
for wheels and editable installs alike.
"""

from __future__ import annotations

import os

from setuptools import setup
from setuptools.command.build_py import build_py

STARTUP_PTH = "lightning_ft-startup.pth"


class BuildWithStartupHook(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(STARTUP_PTH, os.path.join(self.build_lib, STARTUP_PTH))
        if getattr(self, "editable_mode", False):
            # an editable wheel holds what lies in install's directory; build_lib is thrown away
            self.copy_file(STARTUP_PTH, os.path.join(self.get_finalized_command("install").install_lib, STARTUP_PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, STARTUP_PTH)]

    def get_output_mapping(self) -> dict[str, str]:
        return {**super().get_output_mapping(), os.path.join(self.build_lib, STARTUP_PTH): STARTUP_PTH}


setup(cmdclass={"build_py": BuildWithStartupHook})
