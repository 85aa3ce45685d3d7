"""The GCS emulator the tests run (gcp-storage-emulator), answering one more call of the real API:
objects.move (`POST .../o/SRC/moveTo/o/DST`), which gcsfs uses for every rename, as a checkpoint
save's. The emulator answers 501 to it; gcsfs then retries for about 30 s before it falls back to
copy + delete. Real GCS moves the object in one call.

    python -m tests.gcs_emulator start --host=127.0.0.1 --port=PORT --in-memory
"""

from __future__ import annotations

import sys
from http import HTTPStatus

from gcp_storage_emulator import server, settings
from gcp_storage_emulator.__main__ import main
from gcp_storage_emulator.handlers import objects

# GET /_moves?refuse=1 makes every move answer 403 until /_moves?refuse=0: gcsfs then falls back
# to copy + delete at once, logging the error it handled (a test of where such lines go).
REFUSE = {"moves": False}


def moves(request, response, storage, *args, **kwargs) -> None:
    REFUSE["moves"] = request.query.get("refuse", ["0"])[0] == "1"
    response.json({"refuse": REFUSE["moves"]})


def move(request, response, storage, *args, **kwargs) -> None:
    """objects.move within one bucket: the copy's metadata answered, then the source deleted."""
    if REFUSE["moves"]:
        response.status = HTTPStatus.FORBIDDEN
        response.json({"error": {"code": 403, "message": "moves refused (tests/gcs_emulator.py)"}})
        return
    request.params["dest_bucket_name"] = request.params["bucket_name"]
    objects.copy(request, response, storage)
    if response.status == HTTPStatus.OK:
        storage.delete_file(request.params["bucket_name"], request.params["object_id"])


def _routes() -> tuple:
    where = (
        r"/b/(?P<bucket_name>[-.\w]+)/o/(?P<object_id>.*[^/]+)"
        r"/moveTo/o/(?P<dest_object_id>.*[^/]+)$"
    )
    routes = [(rf"^{prefix}{where}", {"POST": move}) for prefix in (settings.API_ENDPOINT, "")]
    return (*routes, (r"^/_moves$", {"GET": moves}))


if __name__ == "__main__":
    server.HANDLERS = (*_routes(), *server.HANDLERS)  # before the generic object route
    main(sys.argv[1:])
