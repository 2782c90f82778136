"""A fake daemon: a plain socket server on a Unix socket that answers every request with
the same JSON after a delay, and prints how many bytes each connection sent it.

Run as a script (stdlib only, so that another user's interpreter can run it):
``python fake_daemon.py SOCKET ROOT DELAY_S``. Prints ``ready`` once listening, then
``got N`` per connection.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

__all__: list[str] = []


def main() -> None:
    path, root, delay = sys.argv[1], sys.argv[2], float(sys.argv[3])
    body = json.dumps({"status": "ok", "version": "fake", "pid": os.getpid(), "root": root,
                       "uptime_s": 1.0, "entries": 666}).encode()
    head = (f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    os.chmod(path, 0o777)
    server.listen(16)
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        conn.settimeout(2.0)
        data = b""
        try:
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                data += chunk
            if data:
                time.sleep(delay)
                conn.sendall(head + body)
        except OSError:
            pass
        print(f"got {len(data)}", flush=True)
        conn.close()


if __name__ == "__main__":
    main()
