"""A tiny HTTP server that the broker tests and bench launch through the `process` operator.

    python tests/http_server.py --port $PORT_HTTP [--port $PORT_STATS] [--delay 1.0]
                                [--slow-instances 1,2] [--fail-instances 0,2] [--wait-file PATH]
                                [--ignore-term] [--term-log PATH] [--child]

GET on any path answers "hello from <BERTH_INSTANCE>". `--delay` waits before listening (a slow
start; with `--slow-instances`, only in the listed instances), `--wait-file` does not listen before
PATH exists (a start that the test ends when it chooses, so "still deploying" is a fact, not a
race), `--fail-instances` exits at once in the listed instances (by BERTH_INSTANCE_INDEX),
`--ignore-term` ignores SIGTERM (so only SIGKILL stops it) and, with `--term-log`, appends a line
to PATH for every SIGTERM it ignored, `--child` starts a child process in the same process group
(to check that release stops the whole group).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time


def serve(ports: list[int], host: str = "127.0.0.1") -> None:
    # Imported only now: a warm pool starts many of these at once, and most of the start-up cost
    # of a Python server is its imports.
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Hello(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = f"hello from {os.environ.get('BERTH_INSTANCE', '?')}\n".encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    servers = [ThreadingHTTPServer((host, port), Hello) for port in ports]
    for server in servers[1:]:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    servers[0].serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, action="append", required=True)
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on ($BERTH_ADDRESS)")
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--slow-instances", default="")
    parser.add_argument("--fail-instances", default="")
    parser.add_argument("--wait-file", default="")
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument("--term-log", default="")
    parser.add_argument("--child", action="store_true")
    args = parser.parse_args()
    index = os.environ.get("BERTH_INSTANCE_INDEX", "")
    if args.fail_instances and index in args.fail_instances.split(","):
        sys.exit(3)
    if args.ignore_term and args.term_log:

        def ignored(signum, frame) -> None:
            with open(args.term_log, "a") as log:
                log.write(f"SIGTERM ignored by {os.getpid()}\n")

        signal.signal(signal.SIGTERM, ignored)
    elif args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.child:
        import subprocess

        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    if not args.slow_instances or index in args.slow_instances.split(","):
        time.sleep(args.delay)
    while args.wait_file and not os.path.exists(args.wait_file):
        time.sleep(0.05)
    serve(args.port, args.host)


if __name__ == "__main__":
    main()
