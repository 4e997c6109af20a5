/**
 * The local runtime's model cache: artifact files fetched once from S3 into a folder, named by
 * their sha256 and verified against it, so a cached file is always the registry's content.
 */
import { GetObjectCommand, type S3Client } from '@aws-sdk/client-s3';
import { createHash, randomBytes } from 'node:crypto';
import { createWriteStream, existsSync, mkdirSync, type WriteStream } from 'node:fs';
import { mkdir, rename, rm, symlink } from 'node:fs/promises';
import { join } from 'node:path';
import { type Readable, Transform } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import { ggufFileNames } from '../../shared/engine-slots';
import type { StoredObject } from '../../shared/model';

export interface ModelCache {
  s3: S3Client;
  bucket: string;
  /** Folder of the cached files (created on first use). */
  dir: string;
}

/**
 * The local path of `file` (`<dir>/<sha256><extension>`), downloading it first unless cached.
 * The download goes to a temporary name and is renamed only once its sha256 matches, so
 * concurrent fetches of one file and interrupted ones never leave a wrong file behind. `signal`
 * aborts the download (it then rejects with `signal.reason`, the temporary file removed).
 */
export async function cachedFile(cache: ModelCache, file: StoredObject, extension: string, signal?: AbortSignal): Promise<string> {
  signal?.throwIfAborted();
  mkdirSync(cache.dir, { recursive: true });
  const path = join(cache.dir, `${file.sha256}${extension}`);
  if (existsSync(path)) return path;
  const tmp = `${path}.tmp-${randomBytes(4).toString('hex')}`;
  const hash = createHash('sha256');
  let out: WriteStream | undefined;
  try {
    const r = await cache.s3.send(new GetObjectCommand({ Bucket: cache.bucket, Key: file.key }), signal ? { abortSignal: signal } : {});
    const hashing = new Transform({
      transform(chunk: Buffer, _enc, cb) {
        hash.update(chunk);
        cb(null, chunk);
      },
    });
    out = createWriteStream(tmp);
    await pipeline(r.Body as Readable, hashing, out, signal ? { signal } : {});
    if (hash.digest('hex') !== file.sha256) throw new Error(`${file.key}: downloaded content does not match its sha256`);
    signal?.throwIfAborted();
    await rename(tmp, path);
  } catch (err) {
    if (signal?.aborted) throw signal.reason as Error;
    throw err;
  } finally {
    // An aborted pipeline settles before the file is closed (or even opened): removing it
    // earlier could leave it behind.
    if (out && !out.closed) await new Promise<void>((r) => out!.once('close', () => r()));
    await rm(tmp, { force: true });
  }
  return path;
}

/**
 * The path to give llama.cpp for a GGUF artifact's `files`: the cached file itself for one file;
 * for a split GGUF, every part cached, then linked into `<dir>/split-<sha256 of part 1>/` under
 * llama.cpp's part names ({@link ggufFileNames}), since llama.cpp opens the first part and finds the
 * others beside it by name. The links are made in a temporary folder renamed into place.
 */
export async function cachedGguf(cache: ModelCache, files: readonly StoredObject[], signal?: AbortSignal): Promise<string> {
  if (files.length === 1) return cachedFile(cache, files[0]!, '.gguf', signal);
  const names = ggufFileNames(files.length);
  const folder = join(cache.dir, `split-${files[0]!.sha256}`);
  const first = join(folder, names[0]!);
  const parts: string[] = [];
  for (const f of files) parts.push(await cachedFile(cache, f, '.gguf', signal));
  if (existsSync(first)) return first;
  const tmp = `${folder}.tmp-${randomBytes(4).toString('hex')}`;
  try {
    await mkdir(tmp);
    for (const [i, part] of parts.entries()) await symlink(part, join(tmp, names[i]!));
    await rename(tmp, folder).catch((err: NodeJS.ErrnoException) => {
      // Another start linked it first: theirs is the same.
      if (!existsSync(first)) throw err;
    });
  } finally {
    await rm(tmp, { recursive: true, force: true });
  }
  return first;
}
