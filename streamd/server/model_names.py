"""The names a client may give as `model`: one place resolves a requested name (`ModelNames.check`).

vLLM serves a model under the string it was started with (`vllm serve Qwen/Qwen2.5-0.5B-Instruct`) and under
every `--served-model-name`; clients written for it send either. streamd accepts both spellings: the served
names (`server.served_model_name`; none given: the short name derived from the model, e.g.
`SmolLM2-135M-Instruct`) and the full `model.name` string. `/v1/models` lists the served names; responses carry
the first.
"""

from __future__ import annotations

from dataclasses import dataclass

from streamd.server.errors import ServiceError


@dataclass(frozen=True, slots=True)
class ModelNames:
    served: tuple[str, ...]  # listed by /v1/models; the first is the name responses carry
    accepted: frozenset[str]  # every name a request may give: the served ones and the full model string

    @classmethod
    def of(cls, served: list[str], model: str | None, derived: str) -> ModelNames:
        """`served`: server.served_model_name; `model`: model.name as given; `derived`: the engine's name."""
        names = tuple(dict.fromkeys(served)) or (derived,)
        return cls(names, frozenset(names) | ({model} if model else set()))

    @property
    def primary(self) -> str:
        return self.served[0]

    def check(self, requested: object) -> None:
        """Refuses a `model` this server does not serve (absent: the primary one), or one that is no string."""
        if requested is not None and not isinstance(requested, str):
            raise ServiceError("invalid_request", f"model must be a string, got {type(requested).__name__}", "model")
        if requested is not None and requested not in self.accepted:
            served = ", ".join(repr(name) for name in self.served)
            raise ServiceError(
                "model_not_found", f"the model {requested!r} does not exist; this server serves {served}", "model"
            )
