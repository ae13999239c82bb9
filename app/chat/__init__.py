"""Models and their prompts, below the services that share them (the router places requests by
these ids, a worker with a tokenizer serves chat with them): ``tokenizer`` (a model's tokenizer
and chat template, exactly as the engine applies them) and ``schemas`` (OpenAI's chat request).
It imports ``app.core`` at most."""

from app.chat.schemas import ChatCompletionRequest, ChatMessage
from app.chat.tokenizer import ChatTemplateError, ModelTokenizer, TokenizerLoadError

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "ChatTemplateError",
    "ModelTokenizer",
    "TokenizerLoadError",
]
