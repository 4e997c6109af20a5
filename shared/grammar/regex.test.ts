import { prng } from '../../test/fixtures/grammar-schemas';
import { matches, parseGbnf } from './gbnf-match';
import { schemaToGbnf } from './index';
import { parseRegex } from './regex';

const grammarOf = (schema: Record<string, unknown>) => {
  const r = schemaToGbnf(schema);
  if (!r.ok) throw new Error(`${JSON.stringify(schema)}: ${r.message}`);
  return parseGbnf(r.gbnf);
};

/** Random strings over `alphabet` (code points), up to `max` long. */
function strings(random: () => number, alphabet: string[], count: number, max: number): string[] {
  return Array.from({ length: count }, () =>
    Array.from({ length: Math.floor(random() * (max + 1)) }, () => alphabet[Math.floor(random() * alphabet.length)]!).join(''),
  );
}

/** The code points a pattern's literals name, and a few others. */
function alphabetOf(pattern: string): string[] {
  const own = [...pattern].filter((c) => !'\\^$()[]{}|*+?'.includes(c));
  return [
    ...new Set([...own, 'a', 'b', 'z', 'A', '0', '5', '9', '_', '-', ' ', '\n', '\t', '"', '\\', '/', 'é', 'ω', '😀', '\u2028', '\u0000', '\u001f', '.', '@']),
  ];
}

const PATTERNS = [
  'abc',
  '^abc$',
  '^a|b$',
  'x(^|-)y',
  '^[a-z]+\\d{2}$',
  '\\d{3}-\\d{4}',
  '^(\\+|00)[1-9][0-9]{2,5}$',
  '^["\\\\]{1,2}$',
  '^[^a-c]*$',
  '^.?$',
  '^[\\s\\S]{2}$',
  '^\\w+@\\w+\\.\\w{2,3}$',
  '^(ab|a)(bc|c)?$',
  '(?:x|y){2,}',
  '^a*?b+?c??$',
  '^(?<word>[a-z]{1,3})-\\1?$'.replace('\\1?', 'z'),
  '^[\\u0041-\\u005a\\x30]+$',
  '^\\u{1F600}|\\uD83D\\uDE00$',
  '^[\\-a]$',
  '^\\.\\*\\+\\?\\(\\)\\[\\]\\{\\}\\|\\/$',
  '^[\\d\\W]$',
  '^[\\t\\n\\v\\f\\r\\0]$',
  '^\\cJ$',
  '[]',
  '^$',
  '',
  '(^a)+b',
  'a$|^$',
];

describe('patterns: the grammar of a pattern accepts JSON.stringify(s) exactly when RegExp(pattern, "u").test(s)', () => {
  test.each(PATTERNS.map((p) => [p]))('%j', (pattern) => {
    const re = new RegExp(pattern, 'u');
    const r = schemaToGbnf({ type: 'string', pattern });
    const random = prng(pattern.length + 1);
    const candidates = [...strings(random, alphabetOf(pattern), 400, 7), 'abc', 'ab12', '555-1234', '+00123', '"\\', 'a@b.cc', '😀', 'ab', 'abbc'];
    if (!r.ok) {
      expect(r.message).toMatch(/No string matches/);
      expect(candidates.some((s) => re.test(s))).toBe(false);
      return;
    }
    const g = parseGbnf(r.gbnf);
    for (const s of candidates) expect([s, matches(g, JSON.stringify(s))]).toEqual([s, re.test(s)]);
  });

  test.each([
    ['^[a-z0-9_]+$', 3, 8],
    ['abc', 0, 5],
    ['é', undefined, 3],
    ['^a|b$', 2, 4],
    ['x(^|-)y', 3, undefined],
    ['\\d', 2, 2],
  ])('%j with minLength %s and maxLength %s: both, exactly', (pattern, minLength, maxLength) => {
    const re = new RegExp(pattern, 'u');
    const g = grammarOf({ type: 'string', pattern, ...(minLength === undefined ? {} : { minLength }), ...(maxLength === undefined ? {} : { maxLength }) });
    const random = prng(5);
    for (const s of strings(random, alphabetOf(pattern), 600, 9)) {
      const n = [...s].length;
      const want = re.test(s) && n >= (minLength ?? 0) && n <= (maxLength ?? Infinity);
      expect([s, matches(g, JSON.stringify(s))]).toEqual([s, want]);
    }
  });

  test('a string is matched decoded: escapes stand for the characters they encode', () => {
    const g = grammarOf({ type: 'string', pattern: '^\\n"\\\\$' });
    expect(matches(g, JSON.stringify('\n"\\'))).toBe(true);
    expect(matches(g, '"\n\\"\\\\"')).toBe(false); // a raw newline is not JSON
    const lengths = grammarOf({ type: 'string', minLength: 1, maxLength: 1 });
    for (const text of ['"\\n"', '"\\u00e9"', '"\\uD83D\\uDE00"', '"😀"', '"\\""']) expect([text, matches(lengths, text)]).toEqual([text, true]);
    for (const text of ['"\\uD83D"', '"\\uDE00"', '"ab"', '""', '"\\uD83D\\uDE00x"']) expect([text, matches(lengths, text)]).toEqual([text, false]);
  });
});

describe('parseRegex refuses what no grammar expresses, naming it', () => {
  test.each([
    ['(a)\\1', /backreference \(\\1\)/],
    ['(?<n>a)\\k<n>', /named backreference/],
    ['a(?=b)', /lookahead/],
    ['a(?!b)', /lookahead/],
    ['(?<=a)b', /lookbehind/],
    ['(?<!a)b', /lookbehind/],
    ['\\bx', /word boundary/],
    ['\\Bx', /non-word boundary/],
    ['\\p{Lu}', /Unicode property escape/],
    ['[\\P{Lu}]', /Unicode property escape/],
    ['(', /not a valid regular expression/],
    ['a{2,1}', /not a valid regular expression/],
    ['\\-', /not a valid regular expression/],
  ])('%j', (pattern, message) => {
    expect(() => parseRegex(pattern)).toThrow(message);
  });
});
