"""Kept for scripts written against the old module: cucache_torch is cucache.torch (the package
python/cucache, `pip install .`). New code: `import cucache.torch; cucache.torch.install()`."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # python/, where cucache/ is
from cucache.torch import *  # noqa: E402,F401,F403
from cucache.torch import __all__  # noqa: E402,F401
