/** Readiness probes: whether a server answers yet. Each resolves false (or rejects) while it does not. */
import { ListBucketsCommand, S3Client } from '@aws-sdk/client-s3';
import { request as httpsRequest } from 'node:https';
import { connect } from 'node:net';

/** A GET of `url` answers 2xx within 2 s. */
export async function httpOk(url: string): Promise<boolean> {
  const res = await fetch(url, { signal: AbortSignal.timeout(2000) });
  return res.ok;
}

/** A GET of `url` with `token` answers 200 within 2 s; the server's (self-signed) certificate is not verified. */
export function httpsOkInsecure(url: string, token: string): Promise<boolean> {
  return new Promise((ok) => {
    const req = httpsRequest(url, { rejectUnauthorized: false, headers: { authorization: `Bearer ${token}` }, timeout: 2000 }, (res) => {
      res.resume();
      ok(res.statusCode === 200);
    });
    req.on('error', () => ok(false));
    req.on('timeout', () => req.destroy());
    req.end();
  });
}

/** Something accepts TCP connections on loopback `port`. */
export function tcpAccepts(port: number): Promise<boolean> {
  return new Promise((ok) => {
    const s = connect(port, '127.0.0.1');
    s.once('connect', () => {
      s.destroy();
      ok(true);
    });
    s.once('error', () => ok(false));
  });
}

/**
 * A signed ListBuckets to the S3 server at `endpoint` answers within 2 s: it serves S3, knows the
 * credentials and can read its store (an anonymous request would prove only the first).
 */
export async function s3Answers(endpoint: string, credentials: { accessKeyId: string; secretAccessKey: string }): Promise<boolean> {
  const s3 = new S3Client({ endpoint, region: 'us-east-1', forcePathStyle: true, credentials, maxAttempts: 1 });
  try {
    await s3.send(new ListBucketsCommand({}), { abortSignal: AbortSignal.timeout(2000) });
    return true;
  } finally {
    s3.destroy();
  }
}
