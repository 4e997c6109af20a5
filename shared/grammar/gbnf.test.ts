import { charSet } from './charset';
import { alt, chars, EMPTY, Grammar, lit, NEVER, rep, seq } from './gbnf';
import { matches, parseGbnf } from './gbnf-match';

const build = (make: (g: Grammar) => Parameters<Grammar['build']>[0]) => {
  const g = new Grammar();
  return g.build(make(g));
};

describe('Grammar', () => {
  test('repeat: every count from min to max, no other, and llama.cpp builds what expandedRules says', () => {
    for (const [min, max] of [
      [0, 64],
      [0, 65],
      [0, 100],
      [3, 130],
      [0, 1100],
      [257, 300],
      [40, null],
      [300, null],
    ] as const) {
      const out = build((g) => g.repeat(lit('a'), min, max, 'a'));
      const parsed = parseGbnf(out.gbnf);
      expect(parsed.rules.length).toBe(out.expandedRules);
      const top = (max ?? min) + 40;
      for (let n = 0; n <= top; n += n < 140 ? 1 : 37)
        expect([min, max, n, matches(parsed, 'a'.repeat(n))]).toEqual([min, max, n, n >= min && (max === null || n <= max)]);
    }
    // Large counts stay small: about n/32 + 64 rules, not n.
    expect(build((g) => g.repeat(lit('a'), 0, 1_000_000, 'a')).expandedRules).toBeLessThan(400);
    expect(build((g) => g.repeat(lit('a'), 999_999, 1_000_000, 'a')).expandedRules).toBeLessThan(100);
  });

  test('literals and classes of any code point print so that llama.cpp reads them back', () => {
    const awkward = '"\\[]-^ \t\n\r\u0000\u007f\u0080é\u2028\uffff😀\u{10ffff}';
    const out = build(() => seq(lit(awkward), chars(charSet([...awkward].map((c) => [c.codePointAt(0)!, c.codePointAt(0)!] as const)))));
    expect(out.gbnf).toMatch(/^[\x20-\x7e\n]*$/);
    const g = parseGbnf(out.gbnf);
    for (const c of awkward) expect([c, matches(g, awkward + c)]).toEqual([c, true]);
    expect(matches(g, `${awkward}x`)).toBe(false);
    expect(matches(g, awkward)).toBe(false);
  });

  test('an empty set is NEVER, never an empty class (llama.cpp would read `[]` as the empty string)', () => {
    expect(chars([])).toBe(NEVER);
    expect(alt(lit('ab'), chars([]))).toEqual(lit('ab'));
    expect(seq(lit('a'), chars([]))).toBe(NEVER);
    expect(rep(NEVER, 0, 3)).toBe(EMPTY);
    expect(rep(NEVER, 1, 3)).toBe(NEVER);
    expect(() => new Grammar().build(NEVER)).toThrow(/empty language/);
  });

  test('rules with the same body are one rule; a repeated group becomes a rule', () => {
    const out = build((g) =>
      seq(g.define('x', alt(lit('ab'), lit('cd'))), g.define('y', alt(lit('ab'), lit('cd'))), rep(seq(lit('e'), lit('f'), alt(lit('g'), lit('h'))), 0, 5)),
    );
    expect(out.gbnf).toBe('root ::= x x root-item{0,5}\nx ::= "ab" | "cd"\nroot-item ::= "ef" [gh]\n');
  });

  test('a rule reached only from root becomes root; unreached rules are left out', () => {
    const g = new Grammar();
    g.define('unused', lit('zz'));
    expect(g.build(g.define('only', alt(lit('a'), lit('bc')))).gbnf).toBe('root ::= "a" | "bc"\n');
  });

  test('left recursion through references is found', () => {
    const g = new Grammar();
    const a = g.declare('a');
    const b = g.declare('b');
    g.set(a, alt(seq({ k: 'ref', name: b }, lit('x')), lit('y')));
    g.set(b, rep({ k: 'ref', name: a }, 0, 1));
    expect(g.leftRecursion({ k: 'ref', name: a })).toBeDefined();
    const h = new Grammar();
    const c = h.declare('c');
    h.set(c, alt(seq(lit('['), { k: 'ref', name: c }, lit(']')), lit('x')));
    expect(h.leftRecursion({ k: 'ref', name: c })).toBeUndefined();
  });
});
