"""API key pools on the controller: secrets stay here and go only into a lease's reply.

The core knows an API's keys by name and limits (`tangram.core.managers.keys`); the config
names, for each key, the environment variable that holds its secret (`ApiKeyConf.key_env`,
`config.py`). Rules:

1. A secret is read from the controller's environment when a lease is granted, and put only
   into that lease's `RESULT` (`key`, beside `key_name`). It is never logged, journaled (the
   core's `Grant` names the key), kept in the ledger or shown by `tangram status`.
2. A key whose variable is unset when the controller starts is left out of the core's pool
   (a warning names the API, the key and the variable, never a value), so no lease gets a
   key without a secret.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import msgpack  # type: ignore[import-untyped]

from tangram.core import commands as cmd
from tangram.core.managers.keys import ApiKey
from tangram_cli.controller.config import ApiConf, ControllerConfig

log = logging.getLogger("tangram.controller.api_keys")


def core_keys(api: ApiConf, environ: Mapping[str, str] = os.environ) -> tuple[ApiKey, ...]:
    """The API's keys the core may hand out: those whose secret is set (rule 2)."""
    keys = []
    for k in api.keys:
        if environ.get(k.key_env):
            keys.append(ApiKey(k.name, k.rpm, k.tpm, k.concurrency))
        else:
            log.warning(
                "API %s: key %s left out: $%s is not set on the controller", api.name, k.name, k.key_env
            )
    return tuple(keys)


def lease_fields(
    config: ControllerConfig, grant: cmd.Grant, environ: Mapping[str, str] = os.environ
) -> dict[str, Any]:
    """What a lease's reply adds for a key of a pool: the secret and the key's name (rule 1)."""
    if not grant.key:
        return {}
    api = next((a for a in config.apis if a.name == grant.api), None)
    conf = next((k for k in api.keys if k.name == grant.key), None) if api is not None else None
    if conf is None:
        return {"key_name": grant.key}
    return {"key": environ.get(conf.key_env, ""), "key_name": grant.key}


def scrub(frames: list[bytes]) -> list[bytes]:
    """A lease's final reply without its key's secret, for what goes to disk (the ledger's
    answers): a reply replayed after a controller restart names its key but carries no secret."""
    if len(frames) < 4:
        return frames
    try:
        doc = msgpack.unpackb(frames[3], raw=False)
    except (ValueError, msgpack.UnpackException):
        return frames
    body = doc.get("body") if isinstance(doc, dict) else None
    if not isinstance(body, dict) or "key" not in body:
        return frames
    doc["body"] = {k: v for k, v in body.items() if k != "key"}
    return [*frames[:3], msgpack.packb(doc, use_bin_type=True), *frames[4:]]
