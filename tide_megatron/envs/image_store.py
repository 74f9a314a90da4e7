"""The env server's node-local image store: screenshots stay off the control connection.

A screenshot is tens of kilobytes (a 224x160 GUI) to megabytes (a 4K desktop). Sending it
inline would put that on the connection every rollout call shares, ahead of small step
replies. Instead the server writes each validated image to a file in a private directory
(in /dev/shm by default: memory, no disk I/O) and replies with an `ImageRef` (id, path,
format, size, sha256). A client on the same node reads the file; one elsewhere asks for the
bytes with the `image` call, which only the session's own connection may make.

Lifetime: a session keeps its newest `keep_per_session` images (older ones are deleted as
new ones arrive) and loses all of them when it closes; the directory goes when the server
stops. Directories left by a server that was killed are removed by the next server that
starts on the node (their owning pid is gone). Thread-safe: images are stored from the
server's worker threads.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import secrets
import shutil
import tempfile
import threading

from tide_megatron.envs.images import ImageInfo
from tide_megatron.envs.protocol import ImageRef

logger = logging.getLogger(__name__)

_DIR_PREFIX = "tide-env-images-"
_DIR_NAME = re.compile(re.escape(_DIR_PREFIX) + r"(\d+)-")
_EXTENSIONS = {"png": "png", "jpeg": "jpg"}


def default_store_root() -> str:
    """/dev/shm when it is a writable directory, else the system temp directory."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return tempfile.gettempdir()


class ImageStore:
    """Image files of one server, grouped by session."""

    def __init__(self, root_dir: str = "", keep_per_session: int = 4):
        if keep_per_session < 1:
            raise ValueError(f"images_kept_per_session must be >= 1, got {keep_per_session}")
        root = root_dir or default_store_root()
        os.makedirs(root, exist_ok=True)
        _remove_orphans(root)
        self.dir = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-", dir=root)  # mode 0700
        self.keep_per_session = keep_per_session
        self._lock = threading.Lock()
        self._by_session: dict[str, collections.deque[ImageRef]] = {}
        self._owner: dict[str, str] = {}  # image id -> session id
        self._closed = False

    def put(self, session_id: str, data: bytes, info: ImageInfo) -> ImageRef:
        """Store validated image bytes for `session_id`; returns their reference."""
        image_id = secrets.token_urlsafe(18)
        path = os.path.join(self.dir, f"{image_id}.{_EXTENSIONS[info.format]}")
        # O_EXCL: a fresh file, never through a link someone planted; written whole before it
        # is published, so a reader never sees part of an image.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        ref = ImageRef(id=image_id, path=path, format=info.format, width=info.width, height=info.height,
                       sha256=info.sha256, nbytes=info.nbytes)
        evicted: list[ImageRef] = []
        with self._lock:
            if self._closed:
                evicted.append(ref)
            else:
                refs = self._by_session.setdefault(session_id, collections.deque())
                refs.append(ref)
                self._owner[image_id] = session_id
                while len(refs) > self.keep_per_session:
                    old = refs.popleft()
                    self._owner.pop(old.id, None)
                    evicted.append(old)
        _unlink(evicted)
        return ref

    def read(self, session_id: str, image_id: str) -> tuple[ImageRef, bytes]:
        """The reference and bytes of a stored image of `session_id`; KeyError when the
        image is not (or no longer) one of that session's."""
        with self._lock:
            if self._owner.get(image_id) != session_id:
                raise KeyError(image_id)
            ref = next(r for r in self._by_session[session_id] if r.id == image_id)
        with open(ref.path, "rb") as f:
            return ref, f.read()

    def release(self, session_id: str) -> None:
        """Delete every image of a session (called when it closes)."""
        with self._lock:
            refs = self._by_session.pop(session_id, ())
            for ref in refs:
                self._owner.pop(ref.id, None)
        _unlink(refs)

    def count(self) -> int:
        with self._lock:
            return len(self._owner)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._by_session.clear()
            self._owner.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


def _unlink(refs) -> None:
    for ref in refs:
        try:
            os.unlink(ref.path)
        except FileNotFoundError:
            pass


def _remove_orphans(root: str) -> None:
    """Remove store directories of servers that died without cleaning up (pid gone)."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        match = _DIR_NAME.match(name)
        if match is None or int(match.group(1)) == os.getpid():
            continue
        path = os.path.join(root, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            logger.info("removing the image store %s of a server that is gone", path)
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue
