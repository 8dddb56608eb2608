"""Plugin files written for ms-swift load unchanged (docs/rewards.md, "ms-swift plugins").

Importing this package registers ms-swift's plugin API with the plugin loader (the one hook
rewards/plugins.py offers, `use_plugin_api`); every caller of load_plugins imports it first:

    import swift_megatron.compat.ms_swift  # noqa: F401  (ms-swift plugin files load)
    modules = load_plugins(paths)   # each file imported inside plugin_api(path)
    funcs = resolve_reward_funcs(..., init_kwargs={"args": flat_args(args)})

shim.py: the stand-in `swift` package, present only during the import, and the registration of
what the plugin put into ms-swift's registries; rewards.py, rollout.py, protocol.py, runtime.py,
utils.py: what that package contains; arguments.py: ms-swift's flat `args` object.
Torch-free (cheap to import).
"""
from swift_megatron.compat.ms_swift.arguments import flat_args
from swift_megatron.compat.ms_swift.shim import (explain_late_import, ms_swift_installed,
                                                 plugin_api)
from swift_megatron.rewards.plugins import PluginApi, use_plugin_api

use_plugin_api(PluginApi(importing=plugin_api, explain_late_import=explain_late_import))

__all__ = ["flat_args", "ms_swift_installed", "plugin_api"]
