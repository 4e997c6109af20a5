/**
 * What the hub client reads of HTTP responses: header values (`Link`, sizes, ETags,
 * `Retry-After`), bodies it discards, and the text of URLs and errors in its messages (never a
 * URL's query: signed CDN URLs carry signatures there; never a server's own words beyond a
 * header value of a known shape, {@link headerText}).
 */

/** The `rel="next"` target of a `Link` header, resolved against the current URL. */
export function nextLink(header: string | null, base: URL): URL | null {
  if (!header) return null;
  for (const part of header.split(',')) {
    const m = /<([^>]*)>\s*;(.*)$/.exec(part.trim());
    if (m && /\brel="?next"?/.test(m[2]!)) return new URL(m[1]!, base);
  }
  return null;
}

/**
 * A URL for messages: origin and path, never the query (signed CDN URLs carry signatures there);
 * a path longer than 200 characters (a redirect's, which a server chose) is cut there.
 */
export function describe(url: URL | string): string {
  const u = typeof url === 'string' ? new URL(url) : url;
  return `${u.origin}${u.pathname.length > 200 ? `${u.pathname.slice(0, 200)}…` : u.pathname}`;
}

/** An error's message for a hub error's text, with its cause's code (`ECONNRESET`) or message when that says more. */
export function errorText(err: unknown): string {
  if (!(err instanceof Error)) return String(err);
  const cause = err.cause as { code?: unknown; message?: unknown } | undefined;
  const causeText =
    cause && typeof cause === 'object' ? (typeof cause.code === 'string' ? cause.code : typeof cause.message === 'string' ? cause.message : '') : '';
  return causeText && causeText !== err.message ? `${err.message} (${causeText})` : err.message;
}

/** An ETag without its weak marker and quotes, or null. */
export function normalizeEtag(etag: string | null): string | null {
  if (!etag) return null;
  return etag.replace(/^W\//, '').replace(/^"(.*)"$/, '$1');
}

/** A size header (`Content-Length`, `X-Linked-Size`) as a safe integer, or null when absent or malformed. */
export function parseSize(value: string | null): number | null {
  if (value === null || !/^\d+$/.test(value.trim())) return null;
  const n = Number(value);
  return Number.isSafeInteger(n) ? n : null;
}

/** `Retry-After` (seconds, or an HTTP date) in milliseconds from now, or undefined. */
export function parseRetryAfter(value: string | null): number | undefined {
  if (!value) return undefined;
  if (/^\d+$/.test(value.trim())) return Number(value) * 1000;
  const at = Date.parse(value);
  return Number.isNaN(at) ? undefined : Math.max(0, at - Date.now());
}

/** Releases a response's connection without reading its body. */
export async function discard(response: Response): Promise<void> {
  try {
    await response.body?.cancel();
  } catch {
    // the connection is gone already; nothing to release
  }
}

/** A header value for a message when it has `shape` (a Content-Range, an encoding's name), else a fixed placeholder: no server text of any other form is echoed. */
export function headerText(value: string | null, shape: RegExp): string {
  if (value === null) return 'none';
  return shape.test(value) && value.length <= 80 ? JSON.stringify(value) : 'a malformed one';
}
