/**
 * Why a schema (or a part of it) cannot become a grammar. Thrown inside the converter and
 * returned as `{ ok: false, keyword, at, message }`; `at` is filled in by the schema walker, which
 * knows the path, when a helper (numbers, regex, automata) does not.
 */
export class Refusal extends Error {
  constructor(
    readonly keyword: string,
    message: string,
    readonly at?: string,
  ) {
    super(message);
    this.name = 'Refusal';
  }
}

export const refuse = (keyword: string, message: string, at?: string): never => {
  throw new Refusal(keyword, message, at);
};
