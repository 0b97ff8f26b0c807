"""Domain errors of the gateway. Each transport maps them to its status codes in one table:
server.py (gRPC) and http.py (HTTP). Messages are for the client: they say what is wrong."""

from __future__ import annotations


# The most of an error message a client gets: messages quote the client's own values (clipped one
# by one), and a request can hold many (100,000 stop ids once made a 356 KB error body).
MAX_MESSAGE_CHARS = 1000


def bounded(message: str) -> str:
    """`message`, cut to MAX_MESSAGE_CHARS with a note of how long it was."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return f"{message[: MAX_MESSAGE_CHARS - 40]}... ({len(message)} characters in all)"


class GatewayError(Exception):
    """Base of the errors a client sees; the message is bounded (`bounded`)."""

    def __init__(self, message: str = "", *args):
        super().__init__(bounded(str(message)), *args)


class InvalidRequest(GatewayError):
    """Bad input: malformed values, unknown model, too long a prompt. (INVALID_ARGUMENT, 400)"""


class UnknownSession(GatewayError):
    """A request names a session the gateway holds no history for. (NOT_FOUND, 404)"""


class NoVerifierAvailable(GatewayError):
    """No live verifier serves the model, or none could be reached. (UNAVAILABLE, 503)"""


class Unauthenticated(GatewayError):
    """No API key, or one this gateway does not know. (UNAUTHENTICATED, 401)"""


class SessionConflict(GatewayError):
    """The session already has a request in flight; turns of one session are sequential, since each
    extends the history the previous one left. (ABORTED, 409)"""


class PayloadTooLarge(GatewayError):
    """The request body exceeds the gateway's limit. (413; gRPC's own message limit answers
    RESOURCE_EXHAUSTED before the servicer runs)"""


class UnsupportedMediaType(GatewayError):
    """A body that is not `application/json`. (415) Web pages can send form and text bodies to
    another origin without a CORS preflight; JSON bodies need one, so this closes that path."""


class Overloaded(GatewayError):
    """Too many requests in flight (the gateway's, or the tenant's), the tenant's token rate spent,
    or every verifier's KV cache full. (RESOURCE_EXHAUSTED, 429 with Retry-After)"""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineExceeded(GatewayError):
    """The request's deadline passed before generation finished. (DEADLINE_EXCEEDED, 504)"""


class UpstreamFailed(GatewayError):
    """A verifier failed after the request started streaming (cut stream, reported error, broken
    protocol). Tokens already streamed stand; the rest never came. (ABORTED, 502)"""


class StreamCut(UpstreamFailed):
    """The verifier's stream broke mid-way at the transport (the process died, or it drained): the
    core resumes the request on another verifier from what streamed (`resume_attempts`), and
    raises this only when it cannot."""


class ShuttingDown(GatewayError):
    """The gateway is shutting down (SIGTERM): new requests are refused, and streams still running
    when the drain grace ends are cut with this error. (UNAVAILABLE, 503 with Retry-After)"""


# Raised by client.py before anything streamed, and handled by the core (next candidate); never
# seen by clients.


class VerifierUnreachable(Exception):
    """The verifier did not answer (connection refused, channel down)."""


class VerifierBusy(Exception):
    """The verifier refused the session for lack of KV cache (RESOURCE_EXHAUSTED)."""
