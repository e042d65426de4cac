"""TLS files for the deployment tests, made with the ``openssl`` command."""
import os
import subprocess


def make_tls(folder, addresses=("127.0.0.1",)) -> dict:
    """A CA and a worker certificate for ``addresses`` (IP subject alternative names), made here with the
    ``openssl`` command (EC P-256, one day): {"cert", "key", "ca"} paths of PEM files."""
    os.makedirs(folder, exist_ok=True)
    f = lambda name: os.path.join(str(folder), name)
    ssl_ = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True, timeout=60)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ssl_("req", "-x509", *ec, "-keyout", f("ca.key"), "-out", f("ca.pem"), "-days", "1", "-subj", "/CN=jmsnas test CA")
    ssl_("req", *ec, "-keyout", f("key.pem"), "-out", f("worker.csr"), "-subj", "/CN=jmsnas worker")
    with open(f("ext.cnf"), "w") as fh:
        fh.write("subjectAltName=" + ",".join(f"IP:{a}" for a in addresses) + "\n")
    ssl_("x509", "-req", "-in", f("worker.csr"), "-CA", f("ca.pem"), "-CAkey", f("ca.key"), "-CAcreateserial",
         "-out", f("cert.pem"), "-days", "1", "-extfile", f("ext.cnf"))
    return {"cert": f("cert.pem"), "key": f("key.pem"), "ca": f("ca.pem")}
