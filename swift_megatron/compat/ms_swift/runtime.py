"""Stand-ins for ms-swift classes that need ms-swift's own runtime (its inference engines, chat
templates, reward-model plugins). A plugin may import them, annotate with them and subclass them;
creating one raises a UserError that names the class and says it needs ms-swift, so a plugin that
depends on them fails loudly at start-up instead of doing nothing.
"""
from swift_megatron.errors import UserError


def needs_ms_swift(name: str, what: str) -> type:
    """A class called `name` (ms-swift's `what`, for the message) whose instances cannot be made."""

    def __init__(self, *args, **kwargs):
        subclass = type(self).__name__
        via = f"{subclass} (a subclass of {name})" if subclass != name else name
        raise UserError(f"{via} needs ms-swift: {name} is ms-swift's {what}, which swift-megatron "
                        f"does not provide. Install ms-swift (pip install ms-swift) for plugins "
                        f"that create one, or remove its use from the plugin file")

    doc = f"ms-swift's {what}; a stand-in: creating one raises UserError (it needs ms-swift)."
    return type(name, (), {"__init__": __init__, "__doc__": doc, "__module__": __name__})


TransformersEngine = needs_ms_swift("TransformersEngine", "transformers inference engine")
VllmEngine = needs_ms_swift("VllmEngine", "vLLM inference engine")
InferClient = needs_ms_swift("InferClient", "client for `swift deploy` servers")
Template = needs_ms_swift("Template", "chat template (encoding and data collation)")
DefaultRMPlugin = needs_ms_swift("DefaultRMPlugin", "reward-model plugin base class")
