"""Services: everything a route handler needs, built once by `create_app` and kept on `app.state.services`.

Its own module so that the routes (ws.py, openai_routes.py) and the app that lists them import it without
importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from streamd.config import ServerConfig
from streamd.engine import EngineClient
from streamd.server.auth import Authenticator
from streamd.server.background import BackgroundResponses
from streamd.server.generation import Generation
from streamd.server.lifecycle import Lifecycle
from streamd.server.logprobs import TokenTexts
from streamd.server.metrics import Metrics
from streamd.server.model_names import ModelNames
from streamd.server.responses_store import ResponseStore
from streamd.server.ws.resume import ResumeStore


@dataclass(slots=True)
class Services:
    config: ServerConfig
    engine: EngineClient
    models: ModelNames  # the names requests may give, and the one responses carry
    started: int
    auth: Authenticator
    metrics: Metrics
    lifecycle: Lifecycle
    generation: Generation
    responses: ResponseStore  # finished Responses, for previous_response_id
    token_texts: TokenTexts  # token id -> text and bytes, for logprobs
    tool_format: str | None  # the tool-call format of the model's chat template ("hermes", "json", None)
    resumes: ResumeStore  # resumable WebSocket requests' tokens and retained output
    background: BackgroundResponses  # `background: true` Responses, by id

    @property
    def model_name(self) -> str:
        """The name responses and /v1/server-info carry."""
        return self.models.primary
