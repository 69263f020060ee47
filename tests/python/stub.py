"""A local HTTP server answering POSTs with a scripted list of statuses, for the clients' retry
policies: the counts are exact."""

import http.server
import json
import threading


class StubServer:
    """A local HTTP server answering POSTs with a scripted list of statuses; counts requests."""

    def __init__(self, statuses):
        self.statuses = list(statuses)
        self.count = 0
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                i = stub.count
                stub.count += 1
                status = stub.statuses[min(i, len(stub.statuses) - 1)]
                body = json.dumps({"detail": f"stub {status}"} if status >= 400 else {"exists": []})
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
