/** The JSON codec of the data plane's messages other than frames (requests, claims, cancels; frames: frames.ts). */

const encoder = new TextEncoder();
const decoder = new TextDecoder();

/** `value` as the UTF-8 bytes of its JSON. */
export const encodeJson = (value: unknown): Uint8Array => encoder.encode(JSON.stringify(value));
/** The value of UTF-8 JSON bytes; throws on malformed JSON. */
export const decodeJson = (bytes: Uint8Array): unknown => JSON.parse(decoder.decode(bytes));
