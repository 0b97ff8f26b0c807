"""`python -m tandem.services.gateway`: the configuration edge of the gateway. Flags become a
GatewaySettings (a JSON file given with --config supplies the rest), then `serve` runs until
SIGTERM / SIGINT."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from pydantic import ValidationError

from tandem.services.gateway.settings import GatewaySettings


def parse_settings(argv: list[str] | None = None) -> GatewaySettings:
    p = argparse.ArgumentParser(prog="python -m tandem.services.gateway", description=__doc__)
    p.add_argument("--config", help="JSON file with GatewaySettings fields (flags override it)")
    p.add_argument("--model", help='HF directory, .gguf file or "default" (only its tokenizer is loaded)')
    p.add_argument("--served-model-name", help="model id clients use (default: the model's own)")
    p.add_argument("--host", help="address both servers bind (default 0.0.0.0)")
    p.add_argument("--http-host")
    p.add_argument("--http-port", type=int)
    p.add_argument("--grpc-host")
    p.add_argument("--grpc-port", type=int)
    p.add_argument("--verifier", dest="verifiers", action="append", help="host:port (repeatable)")
    p.add_argument("--drafter", dest="drafters", action="append", help="host:port (repeatable)")
    p.add_argument("--redis-url", help="redis://host:port/db; omit to route by load alone")
    p.add_argument("--max-tokens-cap", type=int)
    p.add_argument("-v", "--verbose", action="store_true")
    args = vars(p.parse_args(argv))
    verbose = args.pop("verbose")
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    host = args.pop("host")
    if host is not None:
        args["http_host"] = args["http_host"] or host
        args["grpc_host"] = args["grpc_host"] or host
    config = args.pop("config")
    fields = {}
    if config:
        with open(config) as f:
            fields = json.load(f)
    fields.update({k: v for k, v in args.items() if v is not None})
    return GatewaySettings.model_validate(fields)


def main(argv: list[str] | None = None) -> None:
    try:
        settings = parse_settings(argv)
    except (ValidationError, OSError, ValueError) as exc:
        sys.exit(f"gateway: bad configuration: {exc}")
    from tandem.services.gateway.serve import serve

    serve(settings)


if __name__ == "__main__":
    main()
