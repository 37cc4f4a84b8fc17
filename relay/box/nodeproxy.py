"""Node's built-in `fetch` through the box's proxy, on every Node version.

Node's `fetch` (undici) ignores HTTPS_PROXY. Node >= 24 (and 22.21+) honour it under NODE_USE_ENV_PROXY=1,
which the box sets; older Node (the 20 in this project's image and on this machine type) has no switch,
so its `fetch` could not leave the box at all (no route out), which agents read as an outage.

For those, NODE_OPTIONS imports a small preload from a `data:` URL (no file to mount, identical in local
and container mode). It wraps `fetch`; on the first call (not at startup: loading undici costs a node
start 150+ ms here) it installs, as fetch's global dispatcher, undici's own Agent (reached through the
dispatcher fetch creates for a `data:` URL, so nothing is fetched) with a `connect` that opens a CONNECT
tunnel through the proxy (TLS on top for https), and connects directly to the NO_PROXY hosts (the box's
loopback: credential routes). It does nothing on a Node that honours NODE_USE_ENV_PROXY, when no proxy is
set, or when a program installed its own dispatcher before its first fetch. A refused CONNECT fails the fetch with the
proxy's 403 line (a policy, with the command to allow it), not a bare "fetch failed".
"""

from __future__ import annotations

PRELOAD = r"""
import { createRequire } from 'node:module';
const [maj, min] = process.versions.node.split('.').map(Number);
const proxy = process.env.HTTPS_PROXY || process.env.https_proxy || process.env.HTTP_PROXY || process.env.http_proxy;
const key = Symbol.for('undici.globalDispatcher.1');
const original = globalThis.fetch;
const install = () => {
  if (globalThis[key]) return;
  const require = createRequire('/');
  const net = require('node:net');
  const tls = require('node:tls');
  original('data:,').catch(() => {});
  const Agent = globalThis[key] && globalThis[key].constructor;
  if (!Agent) return;
  const via = new URL(proxy);
  const skip = (process.env.NO_PROXY || process.env.no_proxy || '').split(',').map((s) => s.trim().toLowerCase()).filter(Boolean);
  const direct = (h) => skip.some((n) => n === '*' || h === n || h.endsWith(n.startsWith('.') ? n : '.' + n));
  const connect = (o, callback) => {
    let called = false;
    const cb = (err, sock) => { if (!called) { called = true; callback(err, sock); } };
    const host = String(o.hostname).replace(/^\[|\]$/g, '').toLowerCase();
    const secure = o.protocol === 'https:';
    const port = Number(o.port) || (secure ? 443 : 80);
    const upgrade = (sock) => {
      if (!secure) return cb(null, sock);
      const t = tls.connect({ socket: sock, servername: net.isIP(host) ? undefined : (o.servername || host), ALPNProtocols: ['http/1.1'] });
      t.once('secureConnect', () => cb(null, t));
      t.once('error', cb);
    };
    if (direct(host)) {
      const s = net.connect(port, host);
      s.once('connect', () => upgrade(s));
      s.once('error', cb);
      return;
    }
    const target = (host.includes(':') ? '[' + host + ']' : host) + ':' + port;
    const s = net.connect(Number(via.port) || 80, via.hostname.replace(/^\[|\]$/g, ''));
    let buf = Buffer.alloc(0);
    const onData = (chunk) => {
      buf = Buffer.concat([buf, chunk]);
      const end = buf.indexOf('\r\n\r\n');
      if (end < 0) { if (buf.length > 65536) { s.destroy(); cb(new Error('proxy answer too long')); } return; }
      s.removeListener('data', onData);
      const status = buf.subarray(0, buf.indexOf('\r\n')).toString('latin1');
      if (/^HTTP\/1\.[01] 200 /.test(status)) return upgrade(s);
      let body = buf.subarray(end + 4);
      s.on('data', (c) => { if (body.length < 65536) body = Buffer.concat([body, c]); });
      s.once('close', () => cb(new Error('the proxy refused ' + target + ': ' + status + ': ' + body.toString('utf8').trim())));
    };
    s.on('data', onData);
    s.once('error', cb);
    s.once('connect', () => s.write('CONNECT ' + target + ' HTTP/1.1\r\nHost: ' + target + '\r\n\r\n'));
  };
  globalThis[key] = new Agent({ connect });
};
if (!(maj >= 24 || (maj === 22 && min >= 21)) && proxy && typeof original === 'function') {
  let ready = false;
  globalThis.fetch = function fetch(input, init) {
    if (!ready) { ready = true; try { install(); } catch {} }
    return original.call(this, input, init);
  };
}
"""


def node_options() -> str:
    """The NODE_OPTIONS value: the preload as a base64 `data:` URL (no space, so one option)."""
    import base64

    return "--import=data:text/javascript;base64," + base64.b64encode(PRELOAD.strip().encode()).decode()
