/**
 * The hub client's `fetch`: plain HTTP/1.1 over `node:http`/`node:https` whose every connection
 * is checked before it is made. The host's name is resolved once (through an injectable
 * resolver), every address it resolves to is checked against the kinds addresses.ts refuses and
 * the operator's allowed networks, and the socket is opened to exactly those addresses (a lookup
 * pinned to them): no second resolution, so no DNS-rebinding gap between check and connect. An
 * IP literal in the URL is checked the same way. Every hop of a redirect is a request of its own,
 * so each is checked.
 *
 * A refusal is a permanent {@link HubError} (`AddressRefused`) naming the host, the address and
 * its kind. No connection is kept alive: every request opens its own (a model's files are few and
 * large), so nothing outlives the client.
 */
import { promises as dns, type LookupAddress } from 'node:dns';
import * as http from 'node:http';
import * as https from 'node:https';
import { isIP, type LookupFunction } from 'node:net';
import type { Duplex } from 'node:stream';
import { ALLOW_NETWORKS_ENV, describeKind, NO_ALLOWED_NETWORKS, refusedKind, type AllowedNetworks } from './addresses';
import { HubError } from './errors';

/** Resolves a host name to every address it has (default: the system resolver, `dns.lookup` with `all`). */
export type HubResolver = (hostname: string) => Promise<readonly LookupAddress[]>;

export interface HubFetchOptions {
  /** Networks allowed despite their kind (default none). */
  allow?: AllowedNetworks;
  /** Name resolution (default the system's); tests inject their own. */
  resolve?: HubResolver;
  /**
   * Called with a host's checked addresses right before the socket is opened to them; throwing
   * refuses the connection. Tests use it to make sure nothing leaves loopback.
   */
  beforeConnect?: (host: string, addresses: readonly LookupAddress[]) => void;
}

const systemResolver: HubResolver = (hostname) => dns.lookup(hostname, { all: true });

/** Where a host may be connected to, or the refusal. */
class AddressGuard {
  private readonly allow: AllowedNetworks;
  private readonly resolve: HubResolver;
  private readonly beforeConnect: HubFetchOptions['beforeConnect'];

  constructor(opts: HubFetchOptions) {
    this.allow = opts.allow ?? NO_ALLOWED_NETWORKS;
    this.resolve = opts.resolve ?? systemResolver;
    this.beforeConnect = opts.beforeConnect;
  }

  /** The addresses to connect `host` to, every one of them checked; rejects with the refusal. */
  async addresses(host: string): Promise<LookupAddress[]> {
    const literal = isIP(host);
    const addresses: LookupAddress[] = literal !== 0 ? [{ address: host, family: literal }] : [...(await this.resolve(host))];
    if (addresses.length === 0) throw Object.assign(new Error(`${host} has no address`), { code: 'ENOTFOUND' });
    // One refused address refuses the host: a name that also resolves inside is not a public hub.
    for (const { address } of addresses) {
      const kind = refusedKind(address, this.allow);
      if (kind === null) continue;
      const what = literal !== 0 ? `${address} is ${describeKind(kind)}` : `${host} resolves to ${address}, ${describeKind(kind)}`;
      throw new HubError('AddressRefused', `${what}; refused (${ALLOW_NETWORKS_ENV} allows networks)`);
    }
    this.beforeConnect?.(host, addresses);
    return addresses;
  }

  /** An agent's `createConnection`: resolves and checks, then opens the socket pinned to the checked addresses. */
  connect(options: http.ClientRequestArgs, open: (options: http.ClientRequestArgs) => Duplex, callback: (err: Error | null, stream?: Duplex) => void): void {
    const host = (options.host ?? options.hostname ?? 'localhost').replace(/^\[(.*)\]$/, '$1');
    this.addresses(host).then(
      (addresses) => {
        let socket: Duplex;
        try {
          socket = open(isIP(host) !== 0 ? options : { ...options, lookup: pinnedLookup(addresses) });
        } catch (err) {
          callback(err as Error);
          return;
        }
        callback(null, socket);
      },
      (err: Error) => callback(err),
    );
  }
}

/** A lookup that answers with `addresses` only (as `net.connect` asks: one, or all of a family). */
function pinnedLookup(addresses: readonly LookupAddress[]): LookupFunction {
  return (_hostname, options, callback) => {
    const family = options.family === 'IPv4' ? 4 : options.family === 'IPv6' ? 6 : (options.family ?? 0);
    const matching = family === 4 || family === 6 ? addresses.filter((a) => a.family === family) : [...addresses];
    process.nextTick(() => {
      if (matching.length === 0) callback(Object.assign(new Error(`no IPv${family} address`), { code: 'ENOTFOUND' }), '');
      else if (options.all) callback(null, matching);
      else callback(null, matching[0]!.address, matching[0]!.family);
    });
  };
}

class GuardedHttpAgent extends http.Agent {
  constructor(private readonly guard: AddressGuard) {
    super({ keepAlive: false });
  }
  override createConnection(options: http.ClientRequestArgs, callback?: (err: Error | null, stream: Duplex) => void): undefined {
    this.guard.connect(options, (o) => super.createConnection(o)!, callback as (err: Error | null, stream?: Duplex) => void);
    return undefined;
  }
}

class GuardedHttpsAgent extends https.Agent {
  constructor(private readonly guard: AddressGuard) {
    super({ keepAlive: false });
  }
  override createConnection(options: http.ClientRequestArgs, callback?: (err: Error | null, stream: Duplex) => void): undefined {
    this.guard.connect(options, (o) => super.createConnection(o)!, callback as (err: Error | null, stream?: Duplex) => void);
    return undefined;
  }
}

const NULL_BODY = new Set([101, 204, 205, 304]);

/**
 * A response's body as a web stream that reads a chunk only when one is asked for (cheaper than
 * `Readable.toWeb`, which buffers ahead); cancelling it closes the connection.
 */
function bodyStream(res: http.IncomingMessage): ReadableStream<Uint8Array> {
  const chunks = res[Symbol.asyncIterator]() as AsyncIterator<Buffer>;
  return new ReadableStream<Uint8Array>(
    {
      async pull(controller) {
        const next = await chunks.next();
        if (next.done) controller.close();
        else controller.enqueue(next.value);
      },
      cancel() {
        res.destroy();
      },
    },
    { highWaterMark: 0 },
  );
}

/**
 * A `fetch` for the hub client (the subset it uses: GET/HEAD, headers, `redirect: 'manual'`, a
 * signal; redirects are never followed, bodies are not decoded) whose connections are checked as
 * the header says.
 */
export function hubFetch(opts: HubFetchOptions = {}): typeof fetch {
  const guard = new AddressGuard(opts);
  const agents = { http: new GuardedHttpAgent(guard), https: new GuardedHttpsAgent(guard) };
  const send = (input: string | URL | Request, init: RequestInit = {}): Promise<Response> => {
    const url = new URL(input instanceof Request ? input.url : String(input));
    const signal = init.signal ?? undefined;
    const method = init.method ?? 'GET';
    if (url.protocol !== 'http:' && url.protocol !== 'https:') return Promise.reject(new TypeError(`unsupported URL scheme ${url.protocol}`));
    if (init.body != null) return Promise.reject(new TypeError('hubFetch sends no request bodies'));
    if (signal?.aborted) return Promise.reject(signal.reason as Error);
    // Never user info (node:http would send it as Basic credentials, to wherever a redirect points).
    url.username = '';
    url.password = '';
    const headers: Record<string, string> = {};
    new Headers(init.headers).forEach((value, name) => (headers[name] = value));
    return new Promise<Response>((resolve, reject) => {
      const secure = url.protocol === 'https:';
      const req = (secure ? https : http).request(
        url,
        { method, headers, agent: secure ? agents.https : agents.http, ...(signal ? { signal } : {}) },
        (res) => {
          try {
            const status = res.statusCode ?? 0;
            const responseHeaders = new Headers();
            for (let i = 0; i + 1 < res.rawHeaders.length; i += 2) responseHeaders.append(res.rawHeaders[i]!, res.rawHeaders[i + 1]!);
            const body = method === 'HEAD' || NULL_BODY.has(status) ? null : bodyStream(res);
            if (body === null) res.resume();
            resolve(new Response(body, { status, headers: responseHeaders }));
          } catch (err) {
            res.destroy();
            reject(err instanceof Error ? err : new Error(String(err)));
          }
        },
      );
      req.on('error', (err) => reject(signal?.aborted ? (signal.reason as Error) : err));
      req.end();
    });
  };
  return send;
}
