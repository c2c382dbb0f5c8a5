"""A TCP proxy for fault tests: forwards connections to a server, and cuts them all on demand.

``CuttingProxy(host, port)`` listens on a free local port; every connection made to it is
forwarded to ``host:port`` by two threads. ``cut()`` resets every open connection at once (an
RST on both sides, as a dropped network path or a middlebox timeout would), while new connections
keep working. Test code only: it stands in for the network, never for a database.
"""

from __future__ import annotations

import socket
import struct
import threading

from psycopg.conninfo import conninfo_to_dict, make_conninfo

__all__ = ["CuttingProxy", "through"]

_LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on with 0 s: close() sends an RST


class CuttingProxy:
    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self.cuts = 0
        self._closed = False
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=10)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> int:
        """Reset every connection open now; returns how many sockets were cut. (A shutdown
        first: a socket another thread is reading is not closed by ``close`` alone.)"""
        with self._lock:
            cut, self._open = self._open, []
        for sock in cut:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        self.cuts += 1
        return len(cut)

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.cut()


def through(dsn: str, proxy: CuttingProxy) -> str:
    """``dsn`` with its host and port replaced by the proxy's."""
    params = conninfo_to_dict(dsn)
    params.update(host="127.0.0.1", port=str(proxy.port))
    return make_conninfo("", **params)


def endpoint(dsn: str) -> tuple[str, int]:
    params = conninfo_to_dict(dsn)
    return str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432)
