"""POST /tokenize, /detokenize and GET /tokenizer_info (vLLM's extras): the server's own tokenizer and chat template."""
from __future__ import annotations

from pagellm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    TokenizerInfo,
)
from pagellm.entrypoints.openai.serving_base import OpenAIServing


class OpenAIServingTokens(OpenAIServing):
    async def tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        """The token ids a completion (`prompt`) or chat (`messages`) request would send to the model."""
        self.check_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            _, token_ids = await self.render_chat(request)
        else:
            [token_ids] = await self.token_ids_of([request.prompt], request.add_special_tokens, "prompt")
        return TokenizeResponse(count=len(token_ids), max_model_len=self.max_model_len, tokens=token_ids)

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        tokenizer = self.tokenizer()
        self.check_in_vocabulary("tokens", request.tokens, tokenizer.vocab_size)
        return DetokenizeResponse(prompt=tokenizer.decode(request.tokens, skip_special_tokens=False))

    def tokenizer_info(self) -> TokenizerInfo:
        tokenizer = self.tokenizer()
        return TokenizerInfo(bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token,
                             unk_token=tokenizer.unk_token, pad_token=tokenizer.pad_token,
                             chat_template=self.chat_template or tokenizer.chat_template,
                             model_max_length=self.max_model_len, vocab_size=tokenizer.vocab_size)
