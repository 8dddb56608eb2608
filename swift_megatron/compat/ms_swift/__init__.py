"""Plugin files written for ms-swift load unchanged (docs/rewards.md, "ms-swift plugins").

    with plugin_api(path):          # rewards/plugins.py, around the import of one file
        ...import the file...
    funcs = resolve_reward_funcs(..., init_kwargs={"args": flat_args(args)})

shim.py: the stand-in `swift` package, present only during the import, and the registration of
what the plugin put into ms-swift's registries; rewards.py, rollout.py, protocol.py, runtime.py,
utils.py: what that package contains; arguments.py: ms-swift's flat `args` object.
Torch-free (cheap to import).
"""
from swift_megatron.compat.ms_swift.arguments import flat_args
from swift_megatron.compat.ms_swift.shim import ms_swift_installed, plugin_api

__all__ = ["flat_args", "ms_swift_installed", "plugin_api"]
