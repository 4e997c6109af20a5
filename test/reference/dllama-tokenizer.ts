/**
 * How distributed-llama 0.16.4 turns a prompt into token ids, written independently from its
 * `Tokenizer::encode` (src/tokenizer.cpp) so a test can feed llama.cpp exactly the ids
 * `dllama-api` evaluated: the two tokenizers disagree on a llama2-style vocabulary (the models
 * README), so comparing answers needs the same ids on both sides, not the same text.
 *
 * The rule, as the program applies it: ids below the BOS id are the "regular" vocabulary, the rest
 * "special". At each byte, the first special token (in id order) whose bytes start there is
 * taken whole; otherwise the byte joins a buffer that becomes a regular token as soon as the
 * buffer spells one. Then adjacent regular pairs are merged, best score first, while the merged
 * bytes are a regular token. With BOS = 1 (llama2 tokenizers) only `<unk>` is regular, so a
 * prompt is split greedily into the lowest-id special pieces that match, and nothing merges.
 */
import { readFileSync } from 'node:fs';

const MAGIC = 0x567124;
const KEY = { vocabSize: 1, maxTokenLength: 2, bosId: 3, chatTemplate: 7, nEosTokens: 9, addBos: 10 } as const;

export interface DllamaVocabulary {
  pieces: Buffer[];
  scores: number[];
  bosId: number;
  addBos: boolean;
  eosIds: number[];
  chatTemplate: string | null;
}

/** Reads a `.t` file. */
export function readDllamaTokenizer(path: string): DllamaVocabulary {
  const b = readFileSync(path);
  if (b.readInt32LE(0) !== MAGIC) throw new Error(`${path}: not a distributed-llama tokenizer (magic ${b.readInt32LE(0).toString(16)})`);
  const headerSize = b.readInt32LE(4);
  const header = new Map<number, number>();
  for (let at = 8; at < headerSize; at += 8) header.set(b.readInt32LE(at), b.readInt32LE(at + 4));
  let at = headerSize;
  const templateLength = header.get(KEY.chatTemplate) ?? 0;
  const chatTemplate = templateLength > 0 ? b.subarray(at, at + templateLength).toString('utf8') : null;
  at += templateLength;
  const eosIds: number[] = [];
  for (let i = 0; i < (header.get(KEY.nEosTokens) ?? 0); i++, at += 4) eosIds.push(b.readInt32LE(at));
  const pieces: Buffer[] = [];
  const scores: number[] = [];
  for (let i = 0; i < header.get(KEY.vocabSize)!; i++) {
    scores.push(b.readFloatLE(at));
    const length = b.readUInt32LE(at + 4);
    pieces.push(b.subarray(at + 8, at + 8 + length));
    at += 8 + length;
  }
  return { pieces, scores, bosId: header.get(KEY.bosId)!, addBos: header.get(KEY.addBos) !== 0, eosIds, chatTemplate };
}

/** `text`'s token ids as distributed-llama encodes it at the start of a conversation (BOS per the vocabulary). */
export function dllamaEncode(vocab: DllamaVocabulary, text: string): number[] {
  const bytes = Buffer.from(text, 'utf8');
  const regular = new Map<string, number>();
  for (let id = 0; id < vocab.bosId; id++) regular.set(vocab.pieces[id]!.toString('latin1'), id);
  const ids: number[] = vocab.addBos ? [vocab.bosId] : [];
  let pending = '';
  for (let at = 0; at < bytes.length;) {
    let special = -1;
    for (let id = vocab.bosId; id < vocab.pieces.length; id++) {
      const p = vocab.pieces[id]!;
      if (p.length > 0 && bytes.subarray(at, at + p.length).equals(p)) {
        special = id;
        break;
      }
    }
    if (special >= 0) {
      ids.push(special);
      at += vocab.pieces[special]!.length;
      continue;
    }
    pending += String.fromCharCode(bytes[at]!);
    at++;
    const id = regular.get(pending);
    if (id !== undefined) {
      ids.push(id);
      pending = '';
    }
  }
  if (pending !== '') throw new Error(`distributed-llama cannot encode ${JSON.stringify(text)}: bytes left over (the program would overrun its buffer)`);
  for (;;) {
    let best = -1;
    let bestScore = -1e10;
    let bestId = -1;
    for (let i = 0; i + 1 < ids.length; i++) {
      const id = regular.get(vocab.pieces[ids[i]!]!.toString('latin1') + vocab.pieces[ids[i + 1]!]!.toString('latin1'));
      if (id !== undefined && vocab.scores[id]! > bestScore) {
        bestScore = vocab.scores[id]!;
        best = i;
        bestId = id;
      }
    }
    if (best < 0) return ids;
    ids.splice(best, 2, bestId);
  }
}

/** What `dllama-api` 0.16.4 renders for a conversation under its `llama2` template (src/tokenizer.cpp `ChatTemplateGenerator`). */
export function dllamaLlama2Prompt(messages: readonly { role: string; content: string }[], eos: string): string {
  let out = '';
  let i = 0;
  if (messages.length >= 2 && messages[0]!.role === 'system' && messages[1]!.role === 'user') {
    out += `[INST] <<SYS>>\n${messages[0]!.content}\n<</SYS>>\n\n${messages[1]!.content} [/INST]${eos}`;
    i = 2;
  }
  for (; i < messages.length; i++) {
    const m = messages[i]!;
    if (m.role === 'assistant') out += m.content + eos;
    else if (m.role === 'user') out += `[INST] ${m.content} [/INST]${eos}`;
  }
  return out;
}
