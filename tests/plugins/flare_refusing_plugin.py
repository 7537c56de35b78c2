"""A plugin whose import refuses with FLARE's own error (tests/test_run_consistency.py): the CLI must say its message
and its fix once each."""
from flare.errors import FlareError

raise FlareError("this plugin needs a GPU build of its kernels.", key="device", fix="install the plugin's GPU wheel.")
