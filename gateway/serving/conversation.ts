/**
 * The conversation key: every turn of one conversation must map to the same key, so it reaches the
 * same session (and instance, whose KV cache already holds the conversation's prefix).
 *
 * - With an `X-Session-Id` header: HMAC(secret, key scope, model, session id) — the client decides.
 * - Otherwise: HMAC(secret, key scope, model, system prompt, first user message). A chat client
 *   resends the whole history each turn, and those two never change within a conversation.
 *
 * The key's scope (its owner: identity and uid) is always part of the key, so two keys never share a session by choosing the
 * same id or prompt; the secret keeps keys unguessable (they name Temporal workflows and KV keys).
 * All gateway replicas must share the secret, or their keys (and affinity) diverge.
 */
import { createHmac } from 'node:crypto';
import { poolKeyPrefix } from '../../dataplane/session-keys';
import type { ChatMessage } from '../../shared/chat';

/** What a client may send as `X-Session-Id`. */
export const SESSION_ID_PATTERN = '^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$';

export interface ConversationKeyInput {
  /** The calling key's scope (plugins/auth.ts `Principal.conversationScope`): keys never share a conversation. */
  scope: string;
  /** The model's registry identity, `namespace/name`. */
  model: string;
  messages: readonly ChatMessage[];
  sessionId?: string;
}

/** The text of the system prompt: every system message before the first user message. */
function systemPrompt(messages: readonly ChatMessage[]): string {
  let out = '';
  for (const m of messages) {
    if (m.role === 'user') break;
    if (m.role === 'system') out = out === '' ? m.content : `${out}\n${m.content}`;
  }
  return out;
}

/**
 * `<namespace>.<model>.<64 hex digits>`: the conversation's `magus_sessions` key, which carries
 * its pool so that the server can count and filter one pool's entries (dataplane/session-keys.ts);
 * valid as a KV key and in a workflow id.
 */
export function conversationKey(secret: string | Buffer, input: ConversationKeyInput): string {
  const slash = input.model.indexOf('/');
  const pool = poolKeyPrefix(input.model.slice(0, slash), input.model.slice(slash + 1));
  const h = createHmac('sha256', secret);
  // JSON arrays keep the fields unambiguous (no separator a prompt could contain).
  if (input.sessionId !== undefined) h.update(JSON.stringify(['sid', input.scope, input.model, input.sessionId]));
  else h.update(JSON.stringify(['conv', input.scope, input.model, systemPrompt(input.messages), input.messages.find((m) => m.role === 'user')?.content ?? '']));
  return `${pool}.${h.digest('hex')}`;
}
