"""The model's tokenizer: a `tokenizers.Tokenizer` plus the special tokens and chat template of
tokenizer_config.json. Same calls as the tokenizer vLLM's `LLM.get_tokenizer()` returns; byte-fallback
tokens that are not valid UTF-8 decode as llama.cpp decodes them (`byte_fallback`)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as _HFTokenizer

from pdserve.byte_fallback import ByteFallback


class Tokenizer:
    def __init__(self, backend: _HFTokenizer, config: dict[str, Any] | None = None) -> None:
        self.backend = backend
        self.config = dict(config or {})
        self.chat_template: str | None = self.config.get("chat_template")
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.bos_token_id = self.token_to_id(self.bos_token)
        self.eos_token_id = self.token_to_id(self.eos_token)
        self._all_special_ids = {
            idx for idx, tok in backend.get_added_tokens_decoder().items() if tok.special
        }
        self._template: jinja2.Template | None = None
        self._byte_fallback = ByteFallback.of(backend)  # None unless the vocabulary spells bytes as tokens

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.exists():
            raise ValueError(f"{path} has no tokenizer.json")
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        if "chat_template" not in config and (path / "chat_template.jinja").exists():
            config["chat_template"] = (path / "chat_template.jinja").read_text()
        return cls(_HFTokenizer.from_file(str(file)), config)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        self.backend.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps(self.config, indent=2, ensure_ascii=False))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> set[int]:
        return self._all_special_ids

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        if self._byte_fallback is None:
            return text
        return self._byte_fallback.fix(ids, text, lambda some: self.backend.decode(some, skip_special_tokens=False),
                                       self._all_special_ids if skip_special_tokens else set())

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.backend.id_to_token(i) for i in ids]

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **extra: Any,
    ) -> str | list[int]:
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template; send a plain prompt instead")
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        try:
            text = self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **extra,
            )
        except jinja2.TemplateError as e:  # the conversation does not fit the model's template
            raise ValueError(f"chat template error: {e}") from None
        # The template already wrote the special tokens it wants.
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):  # older configs store AddedToken as a dict
        return token.get("content")
    return token


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template error: {message}")
